"""tests/gloo_ranks.py: a teardown abort after the ranks' work passes; any other death fails."""

import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.multiprocessing as mp  # noqa: E402

from tests.gloo_ranks import spawn_ranks  # noqa: E402


def _abort_after_writing(rank: int, out_dir: str, write: bool) -> None:
    if write:
        (Path(out_dir) / f"rank{rank}.txt").write_text("done")
    if rank == 1:
        while write and not (Path(out_dir) / "rank0.txt").exists():  # rank 0 done too, as after a barrier
            time.sleep(0.01)
        os.abort()  # SIGABRT, as gloo's threads at exit


def _raise(rank: int) -> None:
    raise RuntimeError(f"rank {rank} failed")


def test_an_abort_once_every_rank_wrote_its_outputs_passes(tmp_path):
    spawn_ranks(_abort_after_writing, (str(tmp_path), True), 2, [tmp_path / f"rank{rank}.txt" for rank in (0, 1)])


def test_an_abort_before_the_outputs_or_an_exception_fails(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_after_writing, (str(tmp_path), False), 2, [tmp_path / f"rank{rank}.txt" for rank in (0, 1)])
    with pytest.raises(mp.ProcessRaisedException, match="failed"):
        spawn_ranks(_raise, (), 2, [])
