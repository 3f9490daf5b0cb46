"""Two (or more) gloo processes on this machine, for the tests that compare DDP with one process.

gloo's C++ threads can abort a rank's exit after its work is done ("terminate called without an active
exception", SIGABRT): seen in clean-clone runs of `make test` in tests/test_ags.py, tests/test_tula_run.py and
the scripts of tests/test_integrations.py. Two things keep it rare and harmless:
- `gloo_group` leaves the group only after a barrier, so no rank tears its threads down while another still
  talks to it; the worker should have released its DDP models (their reducers hold the group) by then.
- `spawn_ranks` accepts a SIGABRT only where every rank has written its outputs, i.e. after the work; a rank
  that aborts earlier, or dies any other way, fails the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This process as `rank` of a gloo group on 127.0.0.1:`port`; a barrier, then the group destroyed, on the
    way out (the barrier only after the body finished: a failing rank must not wait for the others)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], args: tuple, nprocs: int, outputs: Iterable[Path]) -> None:
    """mp.spawn(worker, args, nprocs), tolerating only a teardown abort: a SIGABRT once every path in `outputs`
    (what the ranks write when their work is done) exists."""
    outputs = list(outputs)
    try:
        mp.spawn(worker, args=args, nprocs=nprocs, join=True)
    except mp.ProcessExitedException as error:
        if error.signal_name != "SIGABRT" or not all(path.exists() for path in outputs):
            raise
