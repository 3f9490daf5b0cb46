"""`tula submit SPEC --reference-stats FILE`: the records file, checked line by line, travels with the job."""

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.conftest import REPO
from tests.handmade import spec_dict
from tula_service.cli.client import with_reference_stats
from tula_service.fit.gradient_stats_file import GradientStatsFileError, read_gradient_stats
from tula_service.spec.job_spec import MAX_GRADIENT_STATS_RECORDS, JobSpec

RECORDS = [
    {"samples": 640, "batch": 32, "grad_sqr": 0.52, "trace_sigma": 41.0, "loss": 2.1, "metric": None, "step": 20,
     "window_steps": 20, "variability": 0.08, "precond_grad_sqr": None, "precond_trace_sigma": None},
    {"samples": 1280, "batch": 32, "grad_sqr": -0.01, "trace_sigma": 38.5, "step": 40},  # a noisy window: still data
]  # fmt: skip


def tula(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tula_service", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# -- the file ---------------------------------------------------------------------------------------


def test_jsonl_and_json_list_files_read_the_same_records(tmp_path):
    jsonl = tmp_path / "stats.jsonl"
    jsonl.write_text(json.dumps(RECORDS[0]) + "\n\n" + json.dumps(RECORDS[1]) + "\n")  # blank lines are skipped
    listed = tmp_path / "stats.json"
    listed.write_text(json.dumps(RECORDS, indent=2))
    assert read_gradient_stats(jsonl) == read_gradient_stats(listed) == RECORDS


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"samples": 1, "batch": 32, "grad_sqr": NaN, "trace_sigma": 1.0}', "line 2: 'grad_sqr' must be a finite number"),
        ('{"samples": 1, "batch": 32, "grad_sqr": "0.5", "trace_sigma": 1.0}', "line 2: 'grad_sqr' must be a finite number"),
        ('{"samples": -5, "batch": 32, "grad_sqr": 0.5, "trace_sigma": 1.0}', "line 2: 'samples' must be at least 0"),
        ('{"samples": 1, "batch": 0, "grad_sqr": 0.5, "trace_sigma": 1.0}', "line 2: 'batch' must be at least 1"),
        ('{"samples": 1.5, "batch": 32, "grad_sqr": 0.5, "trace_sigma": 1.0}', "line 2: 'samples' must be a whole number"),
        ('{"samples": 1, "batch": 32, "grad_sqr": 0.5}', "line 2: 'trace_sigma' is missing"),
        ('{"samples": 1, "batch": 32, "grad_sqr": 0.5, "trace_sigma": 1.0, "lr": 0.1}', "line 2: unknown keys 'lr' (known: samples, batch"),
        ('{"samples": 1, "batch": 32,', "line 2: not JSON"),
        ("[1, 2]", "line 2: a record is a JSON object, got a list"),
        ('{"samples": 64, "batch": 32, "grad_sqr": 0.5, "trace_sigma": 1.0, "statistics_samples": -1}', "line 2: 'statistics_samples' must be at least 0"),
    ],
    ids=["nan", "string", "negative-samples", "zero-batch", "fractional-samples", "missing", "unknown-key", "not-json", "not-object",
         "negative-statistics-samples"],
)
def test_a_bad_record_is_named_by_its_line_and_field(tmp_path, line, message):
    path = tmp_path / "stats.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + line + "\n")
    with pytest.raises(GradientStatsFileError) as error:
        read_gradient_stats(path)
    assert f"{path} {message}" in str(error.value)


def test_every_bad_line_is_reported_not_only_the_first(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps([RECORDS[0], {"samples": 1}, {**RECORDS[1], "batch": -1}]))
    with pytest.raises(GradientStatsFileError) as error:
        read_gradient_stats(path)
    assert error.value.problems == [
        f"{path} item 2: 'batch' is missing",
        f"{path} item 2: 'grad_sqr' is missing",
        f"{path} item 2: 'trace_sigma' is missing",
        f"{path} item 3: 'batch' must be at least 1",
    ]


def test_an_empty_file_and_one_larger_than_a_file_may_hold_are_refused(tmp_path, monkeypatch):
    import tula_service.fit.gradient_stats_file as records_file

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(GradientStatsFileError, match="no records"):
        read_gradient_stats(empty)
    monkeypatch.setattr(records_file, "MAX_FILE_RECORDS", 50)
    line = json.dumps({"samples": 1, "batch": 1, "grad_sqr": 1.0, "trace_sigma": 1.0}) + "\n"
    big = tmp_path / "big.jsonl"
    big.write_text(line * 51)
    with pytest.raises(GradientStatsFileError, match="51 records, more than the 50"):
        read_gradient_stats(big)


def test_more_records_than_a_spec_holds_are_merged_into_windows_that_keep_the_noise_scale():
    from tula_service.fit.gradient_stats_file import coarsen_records
    from tula_service.fit.perfmodel.noise_trajectory import TrajectoryNoiseScale

    records = [{"samples": 64 * (i + 1), "batch": 64, "grad_sqr": 1.0 + (i % 3) * 0.1, "trace_sigma": 50.0 + i,
                "window_steps": 1, "variability": 0.1 * (i % 5), "step": i + 1} for i in range(3 * MAX_GRADIENT_STATS_RECORDS + 7)]  # fmt: skip
    merged = coarsen_records(records, MAX_GRADIENT_STATS_RECORDS)
    assert len(merged) == MAX_GRADIENT_STATS_RECORDS and merged[-1]["samples"] == records[-1]["samples"]
    assert sum(r["window_steps"] for r in merged) == len(records)
    target = records[-1]["samples"]
    assert TrajectoryNoiseScale(window=(0.5, 1.0)).fit(merged, target).noise_scale_ == pytest.approx(
        TrajectoryNoiseScale(window=(0.5, 1.0)).fit(records, target).noise_scale_, rel=0.01)
    JobSpec.model_validate(with_reference_stats(spec_dict(), merged))  # a spec holds them
    records[100]["stability_headroom"], records[101]["stability_headroom"] = 3.0, 1.5  # merged into one window: the smaller
    headrooms = [r["stability_headroom"] for r in coarsen_records(records, MAX_GRADIENT_STATS_RECORDS) if "stability_headroom" in r]
    assert headrooms in ([1.5], [3.0, 1.5])  # the smallest in each window that held one
    records[100]["stability_lr"], records[101]["stability_lr"] = 0.1, 0.4  # 0.3 and 0.6 as LRs: the first is tighter
    pairs = [(r["stability_headroom"], r["stability_lr"]) for r in coarsen_records(records, MAX_GRADIENT_STATS_RECORDS) if "stability_headroom" in r]
    assert pairs in ([(3.0, 0.1)], [(3.0, 0.1), (1.5, 0.4)])  # the smallest headroom x LR, with its own LR
    # where the statistics were taken: the window-steps-weighted mean of the merged records' (statistics_samples where
    # given, else samples), never past the merged record's samples
    placed = [{**r, "window_steps": 1 + i % 2, "statistics_samples": r["samples"] - 32} for i, r in enumerate(records)]
    windows = coarsen_records(placed, MAX_GRADIENT_STATS_RECORDS)
    first = placed[:4]  # 6007 records in 2000 windows: the first seven windows hold 4
    assert windows[0]["window_steps"] == sum(r["window_steps"] for r in first)
    assert windows[0]["statistics_samples"] == round(np.average([r["statistics_samples"] for r in first], weights=[r["window_steps"] for r in first]))
    assert all(w["statistics_samples"] <= w["samples"] for w in windows)


# -- the spec the CLI builds --------------------------------------------------------------------------


def test_the_records_go_to_training_reference_run_creating_it_or_replacing_what_was_there():
    spec = spec_dict()
    assert "reference_run" not in spec["training"]
    assert with_reference_stats(spec, RECORDS)["training"]["reference_run"] == {"gradient_stats": RECORDS}
    spec["training"]["reference_run"] = {"gradient_stats": [RECORDS[1]]}
    assert with_reference_stats(spec, RECORDS[:1])["training"]["reference_run"]["gradient_stats"] == RECORDS[:1]


def test_a_bad_records_file_is_exit_2_naming_the_line_before_anything_is_sent(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict()))
    stats = tmp_path / "stats.jsonl"
    stats.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({**RECORDS[1], "grad_sqr": None}) + "\n")
    result = tula("submit", str(spec), "--reference-stats", str(stats), "--server", "http://127.0.0.1:9")
    assert result.returncode == 2, result.stderr
    assert f"{stats} line 2: 'grad_sqr' must be a finite number" in result.stderr and "cannot reach" not in result.stderr
    missing = tula("submit", str(spec), "--reference-stats", str(tmp_path / "nope.jsonl"), "--server", "http://127.0.0.1:9")
    assert missing.returncode == 2 and "cannot read reference stats" in missing.stderr


# -- against a real server ----------------------------------------------------------------------------


def test_submitted_job_carries_the_records_in_its_spec(api_only, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(name="with-reference-stats")))
    result = tula("submit", str(spec), "--reference-stats", _jsonl(tmp_path / "stats.jsonl", RECORDS), "--json", "--server", api_only.url)
    assert result.returncode == 0, result.stderr
    assert "reference run: 2 gradient-statistics records" in result.stderr
    stored = json.loads(result.stdout)["spec"]["training"]["reference_run"]["gradient_stats"]
    assert [(r["samples"], r["batch"], r["grad_sqr"], r["trace_sigma"]) for r in stored] == [
        (r["samples"], r["batch"], r["grad_sqr"], r["trace_sigma"]) for r in RECORDS
    ]
    assert stored[1]["loss"] is None and stored[0]["variability"] == 0.08
