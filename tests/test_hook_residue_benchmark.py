"""benchmarks/hook_residue.py: its arms' hooks, paired per-round costs, its summary line, a real (short) run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import hook_residue  # noqa: E402

SUMMARY = re.compile(r"^hook_residue: tasks=(\d+) residue_us=(-?[\d.]+) per_parameter_us=(-?[\d.]+) cleared_us=(-?[\d.]+) a_a_us=([\d.]+)$")


def test_the_residue_arm_keeps_an_emptied_hook_dict_on_every_parameter_and_the_cleared_arm_none():
    models = hook_residue.prepared_models("mnist1d_mlp_sgd")
    for arm, model in models.items():
        dicts = [p._backward_hooks for p in model.parameters()]
        if arm == "residue":
            assert all(hooks is not None and len(hooks) == 0 for hooks in dicts)
        else:
            assert all(hooks is None for hooks in dicts)


def test_costs_are_paired_with_plains_round_and_the_residue_is_also_given_per_parameter():
    """Round 2 is slow for every arm (the machine's drift): the paired differences cancel it."""
    plain = [1.0e-3, 2.0e-3, 1.0e-3]
    measured = {"task": "t", "batch": 32, "parameters": 6,
                "seconds": {"plain": plain, "plain_again": [p + 1e-6 for p in plain], "residue": [p + 6e-6 for p in plain],
                            "cleared": [p - 1e-6 for p in plain]}}  # fmt: skip
    row = hook_residue.summarize(measured)
    assert row["plain_us"] == pytest.approx(1000.0) and row["residue_us"] == pytest.approx(6.0)
    assert row["per_parameter_us"] == pytest.approx(1.0) and row["cleared_us"] == pytest.approx(-1.0)
    other = {**row, "residue_us": 40.0, "per_parameter_us": 2.0, "cleared_us": 0.0, "a_a_us": -3.0}
    assert SUMMARY.match(hook_residue.summary_line([row, other])).groups() == ("2", "23.0", "1.50", "-0.5", "2.0")


def test_a_quick_run_writes_only_to_a_temporary_folder(capsys):
    before = {path: path.stat().st_mtime for path in (REPO / "docs" / "validation").glob("hook_residue*")}
    assert hook_residue.main(["--quick", "--tasks", "mnist1d_mlp_sgd", "--rounds", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert SUMMARY.match(lines[-1]) and lines[-1].startswith("hook_residue: tasks=1 ")
    report = Path(lines[-2].removeprefix("report: "))
    assert not report.is_relative_to(REPO) and "| mnist1d_mlp_sgd | 256 | 6 |" in report.read_text()
    assert {path: path.stat().st_mtime for path in (REPO / "docs" / "validation").glob("hook_residue*")} == before
