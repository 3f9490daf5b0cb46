"""benchmarks/client_overhead.py: paired per-round differences, its summary line, and a real (short) run of its arms."""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import client_overhead  # noqa: E402

SUMMARY = re.compile(r"^client_overhead: tasks=(\d+) overhead_pct=(-?[\d.]+) fixed_us=(-?[\d.]+) a_a_pct=([\d.]+) cost_per_call=(-?[\d.]+) sampled_step_pct=(-?[\d.]+)$")


def test_an_arms_cost_is_paired_with_plains_round_and_the_clients_is_a_mean_so_its_rare_sampled_steps_count():
    """Round 3 is slow for every arm (the machine's drift): paired differences cancel it, a difference of medians
    would not. The client's round 4 held a sampled pair: its mean counts it, a median would drop it. Costs in
    microseconds and in % of plain's median step."""
    plain = [1.0e-3, 1.0e-3, 2.0e-3, 1.0e-3]
    measured = {"task": "t", "batch": 64, "client_estimate": {"sample_every": 160},
                "seconds": {"plain": plain, "plain_again": [p + 1e-6 for p in plain], "client": [p + extra for p, extra in zip(plain, (30e-6, 30e-6, 30e-6, 150e-6))],
                            "client_plain_steps": [1.020e-3, 1.025e-3, 2.010e-3, 1.020e-3],
                            "client_every_step": [1.5e-3, 1.6e-3, 2.5e-3, 1.5e-3]},
                "inside": {"client": [12e-6, 14e-6, 13e-6, 40e-6], "client_plain_steps": [10e-6] * 4}}  # fmt: skip
    row = client_overhead.summarize(measured)
    assert row["plain_step_us"] == pytest.approx(1000.0)
    assert row["plain_again_us"] == pytest.approx(1.0) and row["client_us"] == pytest.approx(60.0)
    assert row["client_pct"] == pytest.approx(6.0)
    assert row["client_plain_steps_us"] == pytest.approx(20.0)  # paired: 20, 25, 10, 20
    assert row["client_inside_step_us"] == pytest.approx(13.5) and row["sample_every"] == 160
    assert row["client_stderr_us"] == pytest.approx(statistics.stdev([30, 30, 30, 150]) / 2)
    assert row["plain_again_stderr_us"] == pytest.approx(0.0, abs=1e-6) and row["client_plain_steps_stderr_us"] > 0
    assert row["client_every_step_us"] == pytest.approx(500.0) and row["client_every_step_pct"] == pytest.approx(50.0)  # paired median
    line = client_overhead.summary_line([row, {**row, "client_pct": 5.0, "client_plain_steps_us": 40.0, "plain_again_pct": -0.5,
                                               "client_every_step_pct": 70.0}])  # fmt: skip
    assert row["cost_per_call_second"] == pytest.approx(20.0 / 10.0)  # sampling off: its cost over its calls' seconds
    assert SUMMARY.match(line).groups() == ("2", "5.50", "30.0", "0.30", "2.00", "60.0")


def test_the_standard_error_of_a_mean_is_the_stdevs_and_of_a_median_the_interquartile_ranges():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 1000.0]  # one outlier: it inflates the mean's, not the median's
    assert client_overhead.standard_error(values, of_mean=True) == pytest.approx(statistics.stdev(values) / math.sqrt(10))
    low, _, high = statistics.quantiles(values, n=4)
    assert client_overhead.standard_error(values, of_mean=False) == pytest.approx(1.2533 * (high - low) / 1.349 / math.sqrt(10))
    assert client_overhead.standard_error(values, of_mean=False) < client_overhead.standard_error(values, of_mean=True)
    assert math.isnan(client_overhead.standard_error([1.0], of_mean=True))


def test_a_quick_run_times_every_arm_with_real_clients_and_writes_only_to_a_temporary_folder(capsys):
    before = {path: path.stat().st_mtime for path in (REPO / "docs" / "validation").glob("client_overhead*")}
    assert client_overhead.main(["--quick", "--tasks", "mnist1d_mlp_sgd", "--rounds", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert SUMMARY.match(lines[-1]) and lines[-1].startswith("client_overhead: tasks=1 ")
    report = Path(lines[-2].removeprefix("report: "))
    assert not report.is_relative_to(REPO) and "| mnist1d_mlp_sgd | 256 |" in report.read_text()
    assert {path: path.stat().st_mtime for path in (REPO / "docs" / "validation").glob("client_overhead*")} == before


def test_the_gpu_check_carries_the_clients_fixed_cost_and_overhead_on_its_last_line():
    import gpu_check

    profiled = {"fidelity": [{"max_cv": 0.1, "min_r2": 0.99}], "oom_probe": {"status": "oom"}}
    online_summary = "online: tasks=3 time_ratio_vs_static=1.05 overhead_pct=2.5"
    client_summary = "client_overhead: tasks=3 overhead_pct=3.05 fixed_us=33.3 a_a_pct=0.05 cost_per_call=2.4"
    line = gpu_check.summary_line(profiled, online_summary, client_summary)
    assert line.endswith("online_tasks=3 time_ratio_vs_static=1.05 overhead_pct=2.5 client_fixed_us=33.3 client_overhead_pct=3.05 client_cost_per_call=2.4")
    assert gpu_check.summary_line(profiled, online_summary).endswith("overhead_pct=2.5")
