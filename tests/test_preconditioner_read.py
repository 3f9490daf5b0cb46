"""benchmarks/preconditioner_read.py on one task: P read before the step against the P the step divides by."""

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import preconditioner_read as pr  # noqa: E402

LINE = re.compile(r"^preconditioner_read: tasks=(\d+) median_ratio=([\d.]+) max_ratio=([\d.]+) min_ratio=([\d.]+) reproduced=(\d+)/(\d+)$")


def test_the_steps_preconditioner_reproduces_the_ground_truth_and_the_one_before_the_step_does_not(capsys):
    """The digits MLP under Adamax: with the step's P the service reads what it reads from the cached ground truth; with P
    read before the step (a unit's weights whose exp_inf is still about eps count at 1 / eps) it reads 100x more."""
    assert pr.main(["--quick", "--tasks", "digits_mlp_adamax", "--workers", "1"]) == 0
    out = capsys.readouterr()
    match = LINE.match(out.out.strip().splitlines()[-1])
    assert match, out.out
    tasks, median_ratio, _, _, reproduced, of = match.groups()
    assert (int(tasks), int(reproduced), int(of)) == (1, 1, 1) and float(median_ratio) > 100
    report = Path(re.search(r"report: (\S+)", out.err).group(1))
    assert report.parent != pr.OUT.parent and "| digits_mlp_adamax | adamax |" in report.read_text()  # --quick: a temporary folder


def test_an_unknown_or_non_adaptive_task_is_refused_by_name():
    with pytest.raises(SystemExit, match="digits_mlp_sgd"):
        pr.main(["--quick", "--tasks", "digits_mlp_sgd"])
