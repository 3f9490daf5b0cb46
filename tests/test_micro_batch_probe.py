"""benchmarks/micro_batch_probe.py: it runs, reads every micro-batch size from the same weights, and tells batch norm apart."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import micro_batch_probe as probe  # noqa: E402
from efficiency_tasks import TASKS, task_model  # noqa: E402


def test_batch_norm_is_told_apart_by_the_model_not_the_task_name():
    assert probe.has_batch_norm(task_model(TASKS["digits_resnet_sgd"], 0))
    assert not probe.has_batch_norm(task_model(TASKS["digits_cnn_sgd"], 0))


def test_a_quick_run_reads_every_micro_batch_size_and_prints_the_last_line(monkeypatch):
    monkeypatch.setattr(probe, "QUICK_DRAWS", 4)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert probe.main(["--quick", "--tasks", "digits_cnn_sgd"]) == 0
    lines = stdout.getvalue().strip().splitlines()
    assert re.fullmatch(r"micro_batch_probe: tasks=1 batch_norm_spread_max=nan plain_spread_max=[\d.]+", lines[-1]), lines[-1]
    row = next(line for line in lines if line.startswith("| digits_cnn_sgd |"))
    assert row.count(",") == 2 * len(probe.MICRO_BATCHES) and "| no |" in row
