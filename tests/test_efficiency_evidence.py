"""Which evidence sets B_noise: runs at other batches, then the reference run's statistics, then the pilot,
then the initial weights; each labelled, the others reported beside it."""

import numpy as np
import pytest

from tests.handmade import measurement, spec_dict
from tula_service.plan.recommend import plan
from tula_service.plan.whatif import WhatIf, replan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128]
POINTS = [measurement(b) for b in BATCHES]  # B_noise at initialization: 100
TARGET_SAMPLES = 10 * 50_000  # reference_epochs x num_samples of the hand-made spec


def records(noise_scale_at, count=30, last=TARGET_SAMPLES, batch=32):
    """A reference-run trajectory whose noise scale is noise_scale_at(samples)."""
    step = last // count
    return [{"samples": step * (i + 1), "batch": batch, "grad_sqr": 1.0, "trace_sigma": float(noise_scale_at(step * (i + 1))),
             "window_steps": 5, "variability": 0.3} for i in range(count)]  # fmt: skip


def second_half_progress_weighted(stats):
    """The estimator's read of these records: over the second half, B_eff = sum n (1 - r) / sum (n / b) r with
    r = |G|^2 / (|G|^2 + tr / b), n the samples each record stands for (trapezoid, ends held to the edges)."""
    half = [r for r in stats if r["samples"] >= TARGET_SAMPLES / 2]
    samples = np.array([r["samples"] for r in half], dtype=float)
    spans = np.diff(np.concatenate([[TARGET_SAMPLES / 2], (samples[1:] + samples[:-1]) / 2, [TARGET_SAMPLES]]))
    batch = np.array([r["batch"] for r in half], dtype=float)
    signal = np.array([r["grad_sqr"] / (r["grad_sqr"] + r["trace_sigma"] / r["batch"]) for r in half])
    return float(np.sum(spans * (1 - signal)) / np.sum(spans / batch * signal))


def efficiency(training=None, measurements=POINTS, **overrides):
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training=training or {}, **overrides))
    return plan(spec, measurements)["models"]["efficiency"]


def test_without_training_evidence_the_initial_noise_scale_is_used_and_flagged_weak():
    report = efficiency()
    assert report["noise_scale"]["evidence"] == "initialization" and report["noise_scale"]["value"] == pytest.approx(100.0)
    assert report["weak"] and "grows" in report["warnings"][0]


def test_the_reference_runs_statistics_win_over_the_initial_weights():
    stats = records(lambda s: 1000.0 * s / TARGET_SAMPLES)
    report = efficiency({"reference_run": {"gradient_stats": stats}})
    assert report["noise_scale"]["evidence"] == "reference_run"
    assert report["noise_scale"]["value"] == pytest.approx(second_half_progress_weighted(stats))  # the second half of the run
    assert not report["weak"] and report["noise_scale"]["interval"][0] <= report["noise_scale"]["value"]
    initial = next(c for c in report["evidence"]["candidates"] if c["source"] == "initialization")
    assert initial["ratio_to_used"] == pytest.approx(100.0 / report["noise_scale"]["value"])


def test_a_larger_noise_scale_along_training_predicts_fewer_epochs_at_large_batches():
    at_init = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time")), POINTS)
    trained = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time", training={
        "reference_run": {"gradient_stats": records(lambda s: 2000.0)}})), POINTS)  # fmt: skip
    epochs = lambda rec: {r["global_batch"]: r["epochs"]["value"] for r in rec["candidates"] if r["devices"] == 1}  # noqa: E731
    assert epochs(trained)[128] < epochs(at_init)[128]
    assert epochs(trained)[32] == pytest.approx(10.0) == epochs(at_init)[32]  # both anchored to the reference run


def test_a_pilot_trajectory_is_used_when_the_user_gives_none_and_is_labelled_extrapolated():
    pilot = {"kind": "pilot", "status": "ok", "batch_size": 32,
             "trajectory": records(lambda s: 50.0 * (s / 3200.0) ** 0.5, count=20, last=32_000)}  # fmt: skip
    report = efficiency(measurements=[*POINTS, pilot])
    assert report["noise_scale"]["evidence"] == "pilot"
    assert any("extrapolated" in w for w in report["warnings"]) and report["weak"]  # 6% of the run covered
    low, high = report["noise_scale"]["interval"]
    assert low <= report["noise_scale"]["value"] < high


def test_epochs_at_other_batches_fit_e_min_and_b_noise_and_win_over_statistics():
    training = {"reference_run": {"gradient_stats": records(lambda s: 50.0)},
                "other_runs": [{"batch": 256, "epochs": 10.0 * (1 + 256 / 800) / (1 + 32 / 800)}]}  # fmt: skip
    report = efficiency(training)
    assert report["noise_scale"]["evidence"] == "other_runs" and report["noise_scale"]["value"] == pytest.approx(800.0, rel=1e-3)
    assert "fitted to the measured runs" in report["formula"]
    assert {c["source"] for c in report["evidence"]["candidates"]} == {"other_runs", "reference_run", "initialization"}


def test_other_runs_must_not_repeat_a_batch():
    with pytest.raises(ValueError, match="one run per batch"):
        JobSpec.model_validate(spec_dict(training={"other_runs": [{"batch": 32, "epochs": 3.0}]}))


def test_a_what_if_takes_reference_run_statistics():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")
    rec = replan(stored, POINTS, WhatIf(training={"reference_run": {"gradient_stats": records(lambda s: 3000.0)}}))
    assert rec["models"]["efficiency"]["noise_scale"]["evidence"] == "reference_run"


def test_a_bad_record_names_its_field():
    bad = records(lambda s: 100.0)
    bad[3]["grad_sqr"] = float("nan")
    with pytest.raises(ValueError, match="gradient_stats.3.grad_sqr"):
        JobSpec.model_validate(spec_dict(training={"reference_run": {"gradient_stats": bad}}))


# -- over HTTP: a real server (API only) on SQLite, the job played through the real store --------------------


@pytest.fixture
def api(make_server, tmp_path):
    import httpx

    database_url = f"sqlite:///{tmp_path / 'evidence.db'}"
    server = make_server("--executor", "none", database_url=database_url)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.database_url = database_url
        yield client


def test_a_job_submitted_with_reference_run_statistics_plans_from_them(api):
    from tests.api_fixtures import finished_job, store_for

    stats = records(lambda s: 1000.0 * s / TARGET_SAMPLES)
    job_id = finished_job(store_for(api.database_url), training={"reference_run": {"gradient_stats": stats}})
    rec = api.get(f"/v1/jobs/{job_id}/recommendation").json()
    assert rec["models"]["efficiency"]["noise_scale"]["evidence"] == "reference_run"
    assert rec["models"]["efficiency"]["noise_scale"]["value"] == pytest.approx(second_half_progress_weighted(stats))


def test_a_what_if_over_http_takes_reference_run_statistics_and_rejects_a_bad_record(api):
    from tests.api_fixtures import finished_job, store_for

    job_id = finished_job(store_for(api.database_url))
    stats = records(lambda s: 3000.0)
    response = api.post(f"/v1/jobs/{job_id}/plan", json={"training": {"reference_run": {"gradient_stats": stats}}})
    assert response.status_code == 200, response.text
    assert response.json()["models"]["efficiency"]["noise_scale"]["evidence"] == "reference_run"
    stats[2].pop("grad_sqr")
    bad = api.post(f"/v1/jobs/{job_id}/plan", json={"training": {"reference_run": {"gradient_stats": stats}}})
    assert bad.status_code == 422 and "grad_sqr" in bad.text


def test_adam_reads_the_preconditioned_statistics_and_falls_back_to_the_raw_ones():
    stats = [dict(r, precond_grad_sqr=1.0, precond_trace_sigma=4 * r["trace_sigma"]) for r in records(lambda s: 300.0)]
    adam = efficiency({"optimizer": "adam", "reference_run": {"gradient_stats": stats}})
    sgd = efficiency({"optimizer": "sgd", "reference_run": {"gradient_stats": stats}})
    assert adam["noise_scale"]["value"] == pytest.approx(1200.0) and sgd["noise_scale"]["value"] == pytest.approx(300.0)
    assert adam["evidence"]["candidates"][0]["detail"]["statistic"] == "preconditioned"
    raw_only = efficiency({"optimizer": "adamw", "reference_run": {"gradient_stats": records(lambda s: 300.0)}})
    assert raw_only["noise_scale"]["value"] == pytest.approx(300.0)
    assert any("preconditioned statistics for adamw are missing" in w for w in raw_only["warnings"])


def test_sgd_noise_scales_from_statistics_carry_the_momentum_caveat_and_measured_epochs_do_not():
    from tula_service.fit.efficiency_evidence import MOMENTUM_CAVEAT

    stats = records(lambda s: 500.0)
    assert MOMENTUM_CAVEAT in efficiency({"reference_run": {"gradient_stats": stats}})["warnings"]  # sgd is the default
    assert MOMENTUM_CAVEAT in efficiency()["warnings"]  # the initial weights too
    adam = [{**r, "precond_grad_sqr": 1.0, "precond_trace_sigma": 400.0} for r in stats]
    assert MOMENTUM_CAVEAT not in efficiency({"optimizer": "adam", "reference_run": {"gradient_stats": adam}})["warnings"]
    measured = {"reference_run": {"gradient_stats": stats}, "other_runs": [{"batch": 256, "epochs": 12.0}]}
    assert MOMENTUM_CAVEAT not in efficiency(measured)["warnings"]


def test_the_epochs_say_which_lr_they_are_predicted_for():
    from tula_service.fit.efficiency_evidence import ASSUMED_LR

    stats = records(lambda s: 500.0)
    assert efficiency({"reference_run": {"gradient_stats": stats}})["assumes_lr"] == ASSUMED_LR["advised_rule"]
    assert efficiency()["assumes_lr"] == ASSUMED_LR["advised_rule"]  # the initial weights' statistics too
    measured = {"reference_run": {"gradient_stats": stats}, "other_runs": [{"batch": 256, "epochs": 12.0}]}
    assert efficiency(measured)["assumes_lr"] == ASSUMED_LR["measured_runs"]
    assert "AdaScale" in ASSUMED_LR["advised_rule"]
