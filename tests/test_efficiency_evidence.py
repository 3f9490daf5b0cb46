"""Which evidence sets B_noise: runs at other batches, then the reference run's statistics, then the pilot,
then the initial weights; each labelled, the others reported beside it."""

import numpy as np
import pytest

from tests.handmade import measurement, spec_dict
from tula_service.fit.efficiency_evidence import epoch_model
from tula_service.fit.perfmodel.efficiency import adascale_gain
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


def test_a_reference_run_with_few_records_is_read_by_their_trend_and_says_it_rests_on_them():
    """A trace with a row per epoch reaches an early target in a handful of rows: each is a bin and the trend through
    them is read at the window's middle (noise_trajectory, item 2); the answer says how few they were."""
    grows = lambda s: 1000.0 * s / TARGET_SAMPLES  # noqa: E731
    sparse = records(grows, count=3, last=0.6 * TARGET_SAMPLES)  # at 20%, 40% and 60% of the run: one in the second half
    report = efficiency({"reference_run": {"gradient_stats": sparse}})
    assert report["noise_scale"]["value"] == pytest.approx(grows(0.75 * TARGET_SAMPLES), rel=0.02)  # on the trend
    assert any("only 3 records before the target" in w and "power-law trend" in w for w in report["warnings"]), report["warnings"]
    dense = efficiency({"reference_run": {"gradient_stats": records(grows)}})
    assert not any("records before the target" in w for w in dense["warnings"])


def test_a_log_that_goes_on_past_the_target_brackets_a_window_with_one_record():
    """One row before an early target and the log going on: the first row past the target joins the trend, which is
    then interpolated at the window's middle (noise_trajectory, item 4) and not labelled extrapolated; the answer says
    which record it took."""
    grows = lambda s: 1000.0 * (s / TARGET_SAMPLES) ** 2  # noqa: E731  (a trend only a record past the target shows)
    logged_on = [{"samples": int(f * TARGET_SAMPLES), "batch": 32, "grad_sqr": 1.0, "trace_sigma": grows(f * TARGET_SAMPLES),
                  "window_steps": 5} for f in (0.3, 0.6, 1.4, 2.0)]  # one record in the window [T/2, T]  # fmt: skip
    one_before = logged_on[:2]
    report = efficiency({"reference_run": {"gradient_stats": logged_on}})
    assert report["noise_scale"]["value"] == pytest.approx(grows(0.75 * TARGET_SAMPLES), rel=0.02)
    read = next(c for c in report["evidence"]["candidates"] if c["source"] == "reference_run")["detail"]
    assert read["records_past_target"] == 1 and not read["extrapolated"] and not report["weak"]
    assert any("with the first record past the target" in w for w in report["warnings"]), report["warnings"]
    stopped = efficiency({"reference_run": {"gradient_stats": one_before}})  # the same log cut at the target
    assert stopped["noise_scale"]["value"] != pytest.approx(grows(0.75 * TARGET_SAMPLES), rel=0.1)


def test_records_all_past_the_target_are_named_as_such_where_the_answer_falls_back():
    """A log whose every record lies past reference_epochs x num_samples (a wrong reference_epochs, or samples counted
    per device) reads nothing. The answer says so, with the numbers to check, first among its warnings, and does not
    call the statistics unresolved or ask for statistics the user gave."""
    late = [{"samples": int(f * TARGET_SAMPLES), "batch": 32, "grad_sqr": 1.0, "trace_sigma": 1000.0 * f, "window_steps": 5}
            for f in (1.2, 2.0, 3.0)]  # fmt: skip
    report = efficiency({"reference_run": {"gradient_stats": late}})
    assert report["noise_scale"]["evidence"] == "initialization" and report["weak"]
    first = report["warnings"][0]
    assert first.startswith("reference_run: none of its 3 records lies at or before the target (5e+05 samples seen")
    assert "the first is at 6e+05" in first and "reference_epochs" in first
    assert not any("not resolved" in w for w in report["warnings"])
    unresolved = [{**r, "samples": int(0.3 * r["samples"]), "grad_sqr": -1.0} for r in late]  # before the target, no signal
    assert efficiency({"reference_run": {"gradient_stats": unresolved}})["warnings"][0].startswith(
        "reference_run: the pooled |G|^2 or tr(Sigma) is not positive")


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
    calibrated = report["noise_scale"]["calibrated_interval"]  # the factors measured on pilots that reached 5% of the run
    assert calibrated["calibration"] == "prefix@0.05" and calibrated["value"][1] > high


def _epochs_at(batch, noise_scale=800.0):
    """The epochs of E(B) = E_min (1 + B / B_noise) through the hand-made spec's reference run (10 epochs at 32)."""
    return 10.0 * (1 + batch / noise_scale) / (1 + 32 / noise_scale)


def test_epochs_at_other_batches_fit_e_min_and_b_noise_and_win_over_statistics():
    """Runs at 32 and 256 that say B_noise = 800 against records that read 50: the runs win (their evidence, their
    formula), fitted jointly with the read as a prior, which they outweigh: the fit lands near them, with an
    interval that holds 800, and the disagreement is said."""
    training = {"reference_run": {"gradient_stats": records(lambda s: 50.0)}, "other_runs": [{"batch": 256, "epochs": _epochs_at(256)}]}
    report = efficiency(training)
    noise = report["noise_scale"]
    assert noise["evidence"] == "other_runs" and "fitted to the measured runs, with the reference run's noise scale as a prior" in report["formula"]
    detail = report["evidence"]["candidates"][0]["detail"]
    assert detail["runs_alone"]["noise_scale"] == pytest.approx(800.0, rel=1e-3)
    assert detail["prior"]["read"] == pytest.approx(50.0) and detail["prior"]["calibration"] == "reference_run"
    assert 50.0 < noise["value"] < 800.0 and abs(np.log(noise["value"] / 800.0)) < abs(np.log(noise["value"] / 50.0))
    assert noise["interval"][0] < noise["value"] < noise["interval"][1] and noise["interval"][1] > 800.0
    assert any("outside the 80% range" in w and "reference run's read of 50" in w for w in report["warnings"])
    rec = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training=training)), POINTS)
    for candidate in rec["candidates"]:  # the fit's prediction interval on every candidate, time and cost alike
        low, high = candidate["epochs"]["calibrated_interval"]
        assert low < candidate["epochs"]["value"] < high and candidate["total_time_s"]["calibrated_interval"][0] < candidate["total_time_s"]["value"]
    assert {c["source"] for c in report["evidence"]["candidates"]} == {"other_runs", "reference_run", "initialization"}


def test_runs_close_together_lean_on_the_statistics_and_runs_far_apart_outweigh_them():
    """The same truth (B_noise 800) and the same read (200): a second run at 2x the reference batch moves its epochs by
    little more than a run's scatter, so the joint fit stays nearer the read; one at 16x pins B_noise down. The
    interval narrows accordingly. Without statistics of any kind (no points, no records) there is no prior: the runs
    alone, exactly."""
    fits = {}
    for batch in (64, 512):
        training = {"reference_run": {"gradient_stats": records(lambda s: 200.0)}, "other_runs": [{"batch": batch, "epochs": _epochs_at(batch)}]}
        fits[batch] = efficiency(training)["noise_scale"]
    assert abs(np.log(fits[512]["value"] / 800.0)) < abs(np.log(fits[64]["value"] / 800.0))
    width = {batch: np.log(fit["interval"][1] / fit["interval"][0]) for batch, fit in fits.items()}
    assert width[512] < width[64]
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"other_runs": [{"batch": 64, "epochs": _epochs_at(64)}]}))
    alone = epoch_model(spec, [], None)[1]  # no profiling point, no records
    assert alone["noise_scale"]["value"] == pytest.approx(800.0, rel=1e-3) and alone["noise_scale"]["interval"] is None
    assert any("two runs determine E_min and B_noise exactly" in w for w in alone["warnings"])


def test_the_run_to_measure_next_is_named_until_runs_are_given():
    """Epochs from gradient statistics name the run that would settle them: 8x the reference batch (capped at the data
    set), with the epochs predicted there and their calibrated interval; with the runs given, none."""
    from tula_service.fit.efficiency_evidence import NEXT_RUN_MULTIPLE

    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_run": {"gradient_stats": records(lambda s: 200.0)}}))
    model, report = epoch_model(spec, [], None)
    run = report["next_run"]
    assert run["batch"] == NEXT_RUN_MULTIPLE * 32 and run["predicted_epochs"] == pytest.approx(float(model.predict(run["batch"])))
    low, high = run["predicted_epochs_interval"]
    assert low < run["predicted_epochs"] < high and "training.other_runs" in run["why"]
    small = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32], dataset={"name": "synthetic_images", "num_samples": 100},
                                             training={"reference_run": {"gradient_stats": records(lambda s: 200.0, last=1000)}}))  # fmt: skip
    assert epoch_model(small, [], None)[1]["next_run"]["batch"] == 100  # capped at the data set
    measured = {"other_runs": [{"batch": 256, "epochs": _epochs_at(256)}], "reference_run": {"gradient_stats": records(lambda s: 200.0)}}
    assert efficiency(measured)["next_run"] is None


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


def test_plain_sgd_gets_the_caveat_measured_without_momentum():
    from tula_service.fit.efficiency_evidence import MOMENTUM_CAVEAT, PLAIN_SGD_CAVEAT

    warnings = efficiency({"momentum": 0, "reference_run": {"gradient_stats": records(lambda s: 500.0)}})["warnings"]
    assert PLAIN_SGD_CAVEAT in warnings and MOMENTUM_CAVEAT not in warnings
    assert PLAIN_SGD_CAVEAT not in efficiency({"momentum": 0.5})["warnings"]  # any momentum: the momentum tasks' evidence


def test_rmsprop_reads_the_preconditioned_gradient_and_says_how_little_it_was_measured_on():
    from tula_service.fit.efficiency_evidence import MOMENTUM_CAVEAT, RMSPROP_CAVEAT

    stats = [{**r, "precond_grad_sqr": 1.0, "precond_trace_sigma": 400.0} for r in records(lambda s: 500.0)]
    report = efficiency({"optimizer": "rmsprop", "reference_run": {"gradient_stats": stats}})
    assert report["noise_scale"]["value"] == pytest.approx(400.0, rel=0.05)  # the preconditioned pair's, not the raw 500
    assert RMSPROP_CAVEAT in report["warnings"] and MOMENTUM_CAVEAT not in report["warnings"]
    assert RMSPROP_CAVEAT not in efficiency({"optimizer": "adam", "reference_run": {"gradient_stats": stats}})["warnings"]
    measured = {"optimizer": "rmsprop", "reference_run": {"gradient_stats": stats}, "other_runs": [{"batch": 256, "epochs": 12.0}]}
    assert RMSPROP_CAVEAT not in efficiency(measured)["warnings"]


def test_adam_with_an_l2_term_says_it_was_measured_on_one_task_and_adamw_does_not():
    from tula_service.fit.efficiency_evidence import COUPLED_WEIGHT_DECAY_CAVEAT

    stats = [{**r, "precond_grad_sqr": 1.0, "precond_trace_sigma": 400.0} for r in records(lambda s: 500.0)]
    caveat = COUPLED_WEIGHT_DECAY_CAVEAT.format(optimizer="adam", weight_decay=1e-4)
    assert caveat in efficiency({"optimizer": "adam", "weight_decay": 1e-4, "reference_run": {"gradient_stats": stats}})["warnings"]
    assert "rmsprop with weight_decay 0.001" in " ".join(
        efficiency({"optimizer": "rmsprop", "weight_decay": 1e-3, "reference_run": {"gradient_stats": stats}})["warnings"])
    for training in ({"optimizer": "adam"}, {"optimizer": "adamw", "weight_decay": 0.1}, {"optimizer": "adam", "weight_decay": 1e-4,
                     "other_runs": [{"batch": 256, "epochs": 12.0}]}):  # fmt: skip
        warnings = efficiency({**training, "reference_run": {"gradient_stats": stats}})["warnings"]
        assert not any("an L2 term" in w for w in warnings), training


def test_adafactor_reads_the_preconditioned_gradient_and_its_decay_is_decoupled():
    from tula_service.fit.efficiency_evidence import adam_variant_caveat

    stats = [{**r, "precond_grad_sqr": 1.0, "precond_trace_sigma": 400.0} for r in records(lambda s: 500.0)]
    report = efficiency({"optimizer": "adafactor", "weight_decay": 1e-3, "reference_run": {"gradient_stats": stats}})
    assert report["noise_scale"]["value"] == pytest.approx(400.0, rel=0.05)
    assert adam_variant_caveat("adafactor") in report["warnings"] and "factored second moment" in adam_variant_caveat("adafactor")
    assert not any("an L2 term" in w for w in report["warnings"])  # torch.optim.Adafactor shrinks theta by lr wd, outside P


def test_nadam_radam_adamax_and_adagrad_read_the_preconditioned_gradient_and_their_l2_term_unless_decoupled():
    from tula_service.fit.efficiency_evidence import adam_variant_caveat

    stats = [{**r, "precond_grad_sqr": 1.0, "precond_trace_sigma": 400.0} for r in records(lambda s: 500.0)]
    for optimizer in ("nadam", "radam", "adamax", "adagrad"):
        report = efficiency({"optimizer": optimizer, "reference_run": {"gradient_stats": stats}})
        assert report["noise_scale"]["value"] == pytest.approx(400.0, rel=0.05)  # the preconditioned pair's, not the raw 500
        assert adam_variant_caveat(optimizer) in report["warnings"] and f"{optimizer}: read as Adam's is" in adam_variant_caveat(optimizer)
        coupled = efficiency({"optimizer": optimizer, "weight_decay": 1e-3, "reference_run": {"gradient_stats": stats}})["warnings"]
        assert f"{optimizer} with weight_decay 0.001" in " ".join(coupled)
        if optimizer in ("adamax", "adagrad"):
            continue  # their decay is always an L2 term
        decoupled = {"optimizer": optimizer, "weight_decay": 1e-3, "decoupled_weight_decay": True, "reference_run": {"gradient_stats": stats}}
        assert not any("an L2 term" in w for w in efficiency(decoupled)["warnings"]), optimizer
    assert not any("read as Adam's is" in w for w in efficiency({"optimizer": "adam", "reference_run": {"gradient_stats": stats}})["warnings"])


def test_runs_that_do_not_follow_the_form_are_flagged_and_runs_that_do_are_not():
    """The ResNet under SGD with Nesterov momentum of benchmarks/efficiency_tasks.py: 2.5 epochs at 32, 6.3 at 256 and 37 at
    512, a blow-up; the same batches on the form E_min (1 + B / 100) carry no such warning."""
    def warnings(epochs):
        other_runs = [{"batch": b, "epochs": e} for b, e in epochs.items()]
        return " ".join(efficiency({"reference_batch": 32, "reference_epochs": 2.54, "other_runs": other_runs})["warnings"])

    assert "do not follow the form" in warnings({64: 2.94, 128: 3.92, 256: 6.32, 512: 37.1})
    assert "do not follow the form" not in warnings({b: 2.54 * (1 + b / 100) / (1 + 32 / 100) for b in (64, 128, 256, 512)})
    assert "do not follow the form" not in warnings({512: 37.1})  # two runs: nothing to check the fit against


def test_the_epochs_say_which_lr_they_are_predicted_for():
    from tula_service.fit.efficiency_evidence import ASSUMED_LR

    stats = records(lambda s: 500.0)
    assert efficiency({"reference_run": {"gradient_stats": stats}})["assumes_lr"] == ASSUMED_LR["advised_rule"]
    assert efficiency()["assumes_lr"] == ASSUMED_LR["advised_rule"]  # the initial weights' statistics too
    measured = {"reference_run": {"gradient_stats": stats}, "other_runs": [{"batch": 256, "epochs": 12.0}]}
    assert efficiency(measured)["assumes_lr"] == ASSUMED_LR["measured_runs"]
    assert "AdaScale" in ASSUMED_LR["advised_rule"]


def _with_headroom(stats, headrooms):
    """Records with a measured stability headroom on the last len(headrooms) of them."""
    stats = [dict(r) for r in stats]
    for record, value in zip(stats[-len(headrooms):], headrooms):
        record["stability_headroom"] = value
    return stats


def test_a_measured_stability_headroom_caps_the_advised_lr_and_raises_the_epochs_it_caps():
    stats = records(lambda s: 500.0)
    free = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time", training={
        "reference_lr": 0.1, "reference_run": {"gradient_stats": stats}})), POINTS)  # fmt: skip
    capped = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time", training={
        "reference_lr": 0.1, "reference_run": {"gradient_stats": _with_headroom(stats, [1.6, 1.2, 1.4])}})), POINTS)  # fmt: skip
    report = capped["models"]["efficiency"]["lr_headroom"]
    assert report["value"] == 1.2 and report["source"] == "measured" and "reference_run, second half: 3 records" in report["evidence"]
    assert free["models"]["efficiency"]["lr_headroom"] is None
    epochs = lambda rec: {r["global_batch"]: r["epochs"]["value"] for r in rec["candidates"] if r["devices"] == 1}  # noqa: E731
    free_epochs, capped_epochs = epochs(free), epochs(capped)
    assert capped_epochs[32] == pytest.approx(free_epochs[32])  # the reference batch runs at the reference LR either way
    assert capped_epochs[128] > free_epochs[128] * 1.05  # the AdaScale gain at 4x the reference (about 3.3) is capped at 1.2
    row = next(r for r in capped["candidates"] if r["devices"] == 1 and r["global_batch"] == 128)
    low, high = row["epochs"]["interval"]  # no cost from the cap .. the quadratic model's; the value their geometric middle
    assert low == pytest.approx(free_epochs[128]) and capped_epochs[128] == pytest.approx((low * high) ** 0.5) and "12 of 14" in row["epochs"]["why"]
    assert all("interval" not in r["epochs"] for r in capped["candidates"] if r["global_batch"] <= 32)  # not capped there
    assert all("interval" not in r["epochs"] for r in free["candidates"])
    from tula_service.fit.perfmodel.efficiency import EpochModel
    from tula_service.plan.advice import lr_rule

    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_lr": 0.1}))
    rule = lr_rule(spec, 128, EpochModel(32, 10.0, 500.0, lr_headroom=1.2))
    assert rule["multiplier"]["value"] == pytest.approx(1.2) and rule["lr"]["value"] == pytest.approx(0.12)
    assert rule["stability"]["source"] == "measured" and "1.2x" in rule["stability"]["why"] and "capped" in rule["why"]
    roomy = lr_rule(spec, 128, EpochModel(32, 10.0, 500.0, lr_headroom=50.0))
    assert roomy["multiplier"]["value"] == pytest.approx(adascale_gain(4, 500.0, 32)) and "capped" not in roomy["why"]


def test_with_max_lr_too_the_lower_cap_wins_and_a_headroom_above_the_rule_changes_nothing():
    from tula_service.fit.perfmodel.efficiency import EpochModel
    from tula_service.plan.advice import lr_rule

    stats = _with_headroom(records(lambda s: 500.0), [1.2])
    with_max_lr = efficiency({"reference_lr": 0.1, "max_lr": 0.3, "reference_run": {"gradient_stats": stats}})
    assert with_max_lr["lr_headroom"]["value"] == 1.2 and with_max_lr["max_step_gain"]["value"] == pytest.approx(3.0)
    for max_lr, source, lr in ((0.3, "measured", 0.12), (0.11, "spec", 0.11)):
        spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_lr": 0.1, "max_lr": max_lr}))
        rule = lr_rule(spec, 128, EpochModel(32, 10.0, 500.0, lr_headroom=1.2))
        assert rule["stability"]["source"] == source and rule["lr"]["value"] == pytest.approx(lr)
    roomy = _with_headroom(records(lambda s: 500.0), [50.0])
    assert efficiency({"reference_run": {"gradient_stats": roomy}})["noise_scale"]["value"] == pytest.approx(
        efficiency({"reference_run": {"gradient_stats": records(lambda s: 500.0)}})["noise_scale"]["value"])


def test_a_non_positive_stability_headroom_is_a_named_422_field():
    bad = _with_headroom(records(lambda s: 500.0), [0.0])
    with pytest.raises(ValueError, match="stability_headroom"):
        JobSpec.model_validate(spec_dict(training={"reference_run": {"gradient_stats": bad}}))


def test_the_capped_step_costs_the_quadratic_models_extra_steps():
    """McCandlish et al. 2018, Sec. 2.2: progress 2x - x^2 (1 + B_noise / B) of the best step, with x the step over
    eps_max; the reference LR is the best at B_ref, x_ref = 1 / (1 + B_noise / B_ref), and the cap is h x_ref. That
    cost q is the interval's upper end; the prediction is the geometric middle of no cost and q."""
    from tula_service.fit.perfmodel.efficiency import EpochModel

    noise, reference, headroom = 80.0, 32, 1.1
    model, free = EpochModel(reference, 4.0, noise, lr_headroom=headroom), EpochModel(reference, 4.0, noise)
    cap = headroom / (1 + noise / reference)
    for batch in (64, 128, 256):
        best = 1 / (1 + noise / batch)
        by_hand = best / (2 * cap - cap**2 * (1 + noise / batch))
        assert float(model.predict(batch)) == pytest.approx(float(free.predict(batch)) * by_hand**0.5)
        assert model.cap_interval(batch) == pytest.approx((float(free.predict(batch)), float(free.predict(batch)) * by_hand))
        assert by_hand > 1 and model.lr_capped(batch) and model.lr_multiplier(batch) == pytest.approx(headroom)
    assert float(model.predict(32)) == pytest.approx(4.0) and float(model.predict(16)) == pytest.approx(float(free.predict(16)))
    adam = EpochModel(reference, 4.0, noise, optimizer="adam", lr_headroom=headroom)
    assert adam.cap_gain() == pytest.approx(headroom**2) and adam.lr_multiplier(1024) == pytest.approx(headroom)
    assert EpochModel(reference, 4.0, noise, lr_headroom=0.5).lr_headroom == 1.0  # already past the edge: no raise at all
    low, high = model.cap_interval(256)  # from no cost of the cap to the quadratic model's
    assert low < float(model.predict(256)) < high
    assert model.cap_interval(16) is None and free.cap_interval(256) is None


def test_the_headroom_is_read_where_the_noise_scale_is_the_second_half_of_the_run():
    """An early dip (the sharpness swings at the start of a run) does not cap the LR when the second half was measured."""
    stats = [dict(r) for r in records(lambda s: 500.0)]  # 30 records up to the target
    stats[5]["stability_headroom"], stats[20]["stability_headroom"], stats[28]["stability_headroom"] = 0.4, 2.5, 1.8
    report = efficiency({"reference_run": {"gradient_stats": stats}})["lr_headroom"]
    assert report["value"] == 1.8 and report["evidence"].startswith("reference_run, second half: 2 records")
    del stats[20]["stability_headroom"], stats[28]["stability_headroom"]
    early = efficiency({"reference_run": {"gradient_stats": stats}})["lr_headroom"]
    assert early["value"] == 0.4 and early["evidence"].startswith("reference_run, first half only")


def test_a_headroom_measured_at_another_lr_is_read_relative_to_the_reference_lr():
    """h eta is the largest stable LR whatever eta it was measured at: h = 4 at a decayed LR 0.025 is a cap of 1x a
    reference LR of 0.1, and the most restrictive record is the one with the smallest h x stability_lr."""
    stats = [dict(r) for r in records(lambda s: 500.0)]
    stats[20].update(stability_headroom=4.0, stability_lr=0.025)  # LR decayed to a quarter: 1.0x the reference LR
    stats[28].update(stability_headroom=1.5, stability_lr=0.1)  # at the reference LR: 1.5x
    report = efficiency({"reference_lr": 0.1, "reference_run": {"gradient_stats": stats}})["lr_headroom"]
    assert report["value"] == pytest.approx(1.0) and "measured at LR 0.025: 4x that, 1x reference_lr" in report["evidence"]
    without_reference_lr = efficiency({"reference_run": {"gradient_stats": stats}})["lr_headroom"]
    assert without_reference_lr["value"] == 1.5 and "taken as measured at the reference LR (no training.reference_lr)" in without_reference_lr["evidence"]


def test_records_with_no_resolved_signal_fall_back_to_the_next_evidence_and_the_answer_stays_finite():
    import json

    stats = [{"samples": 10_000 * (i + 1), "batch": 32, "grad_sqr": 1e-100, "trace_sigma": 1e99, "window_steps": 5} for i in range(50)]
    rec = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_run": {"gradient_stats": stats}})), POINTS)
    json.dumps(rec, allow_nan=False)  # a 500 before: the pooled ratio and the curves overflowed to inf
    report = rec["models"]["efficiency"]
    assert report["noise_scale"]["evidence"] == "initialization"
    reference = next(c for c in report["evidence"]["candidates"] if c["source"] == "reference_run")
    assert reference["noise_scale"] is None and "ratio is past 1e+15 samples" in reference["warnings"][-1]


def _overflowed(batch, value):
    """A compute point as the dispatcher stores it when the worker wrote a non-finite |G|^2: without_nonfinite."""
    import json

    from tula_service.measurement import without_nonfinite

    point = measurement(batch)
    point["gradient"]["true_grad_sq_norm"] = value
    point["gradient"]["variability_series"] = [0.2, value]
    return without_nonfinite(json.loads(json.dumps(point)))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, -1e300])
def test_points_whose_gradient_statistics_overflowed_are_left_out_and_named(value):
    import json

    points = [*POINTS[:3], *(_overflowed(b, value) for b in BATCHES[3:])]
    rec = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)), points)
    json.dumps(rec, allow_nan=False)  # a crash before: NaN in the answer, or an overflow in the pooled sums
    report = rec["models"]["efficiency"]
    assert report["noise_scale"]["evidence"] == "initialization" and report["noise_scale"]["value"] == pytest.approx(100.0)
    assert any("batch 64, 128 were not finite or past +-1e+100" in w for w in report["warnings"])


def test_with_every_points_statistics_overflowed_the_efficiency_is_assumed_and_says_why():
    rec = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)), [_overflowed(b, float("nan")) for b in BATCHES])
    report = rec["models"]["efficiency"]
    assert report["source"] == "assumed" and report["noise_scale"] is None
    assert report["warnings"] == [f"initialization: the gradient statistics of the points at batch {', '.join(map(str, BATCHES))} "
                                  "were not finite or past +-1e+100 (an fp16 overflow, a diverging model): left out"]  # fmt: skip


def test_a_record_without_nonfinite_numbers_keeps_json_and_lists_where_they_were():
    from tula_service.measurement import without_nonfinite

    record = {"kind": "compute", "iter_time": {"median_s": 0.1, "cv": float("inf")}, "series": [1.0, float("nan")], "n": 3}
    assert without_nonfinite(record) == {"kind": "compute", "iter_time": {"median_s": 0.1, "cv": None}, "series": [1.0, None], "n": 3,
                                         "nonfinite_fields": ["iter_time.cv", "series[1]"]}  # fmt: skip
    assert without_nonfinite({"kind": "compute", "n": 1.5}) == {"kind": "compute", "n": 1.5}


def test_records_at_another_batch_are_read_over_the_second_half_of_their_own_run_to_the_target():
    """A run at 8 x B_ref needs E(256) D samples, several times the reference run's T: its noise scale is read
    over the second half of that (efficiency_evidence.run_target_samples), where it has grown further."""
    grows = lambda s: 100.0 * s / TARGET_SAMPLES  # noqa: E731
    at_256 = efficiency({"reference_run": {"gradient_stats": records(grows, count=120, last=8 * TARGET_SAMPLES, batch=256)}})
    read, detail = at_256["noise_scale"]["value"], at_256["evidence"]["candidates"][0]["detail"]
    epochs_at_256 = 10 * (1 + 256 / read) / (1 + 32 / read)  # E(b) = E_ref (1 + b / B) / (1 + B_ref / B)
    assert detail["target_samples"] == pytest.approx(epochs_at_256 * 50_000, rel=1e-3)  # the fixed point T = E(256; B(T)) D
    assert TARGET_SAMPLES < detail["target_samples"] < 8 * TARGET_SAMPLES
    assert any("read as a run of" in w for w in at_256["warnings"])
    # the reference run's own T would read the first part of the run at 256, where the noise scale is smaller
    at_reference_target = [r for r in records(grows, count=120, last=8 * TARGET_SAMPLES, batch=32)]
    assert read > efficiency({"reference_run": {"gradient_stats": at_reference_target}})["noise_scale"]["value"] * 1.5
    same = efficiency({"reference_run": {"gradient_stats": records(grows, batch=32)}})["evidence"]["candidates"][0]["detail"]
    assert same["target_samples"] == TARGET_SAMPLES  # at the reference batch, the reference run's T


def _pilot_with_loss(loss_at):
    """A pilot over 6% of the run reading B_noise 2 000 (a large read: the AdaScale gain raises the LR far), its
    training loss loss_at(i) at record i."""
    trajectory = records(lambda s: 2000.0, count=20, last=32_000)
    return {"kind": "pilot", "status": "ok", "batch_size": 32, "trajectory": [{**r, "loss": loss_at(i)} for i, r in enumerate(trajectory)]}


def test_a_pilot_whose_loss_did_not_fall_does_not_raise_the_lr():
    """A plateau (the loss of chance, flat: the GRU under SGD's pilot, docs/validation.md) says nothing about the rest
    of training: the LR stays at the reference LR, and the answer says why; the same pilot with a falling loss raises
    it by the AdaScale gain."""
    flat = _pilot_with_loss(lambda i: 2.303 + 0.004 * (-1) ** i)
    learning = _pilot_with_loss(lambda i: 2.303 - 0.02 * i)
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time", training={"reference_lr": 0.1}))
    kept, raised = plan(spec, [*POINTS, flat]), plan(spec, [*POINTS, learning])
    headroom = kept["models"]["efficiency"]["lr_headroom"]
    assert headroom["value"] == 1.0 and headroom["source"] == "assumed" and "a plateau" in headroom["evidence"]
    assert any("had not begun to learn" in w for w in kept["models"]["efficiency"]["warnings"])
    assert kept["training_advice"]["lr_rule"]["lr"]["value"] <= 0.1 + 1e-12
    at_128 = next(c for c in kept["candidates"] if c["global_batch"] == 128 and c["devices"] == 1)["epochs"]
    assert at_128["why"].startswith("the LR is capped at the reference LR: the pilot's records are a plateau")
    assert raised["models"]["efficiency"]["lr_headroom"] is None
    assert raised["training_advice"]["lr_rule"]["lr"]["value"] > 0.1 or raised["chosen"]["global_batch"] <= 32
    at = lambda rec, b: next(c for c in rec["candidates"] if c["global_batch"] == b and c["devices"] == 1)["epochs"]["value"]  # noqa: E731
    assert at(kept, 128) > at(raised, 128)  # a step at the reference LR is worth less at a larger batch


def test_the_loss_fall_compares_the_first_and_last_quarters_of_the_records():
    from tula_service.fit.efficiency_evidence import loss_fall
    from tula_service.spec.job_spec import GradientStatsRecord

    made = lambda losses: [GradientStatsRecord(samples=100 * (i + 1), batch=32, grad_sqr=1.0, trace_sigma=1.0, loss=v) for i, v in enumerate(losses)]  # noqa: E731
    fall = loss_fall(made([4.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0]))  # quarters: (4, 4) and (1, 1)
    assert fall == {"fall": pytest.approx(0.75), "first": 4.0, "last": 1.0}
    assert loss_fall(made([2.0, 2.0, 2.0])) is None  # too few to tell
    assert loss_fall(made([1.0, 2.0, 3.0, 4.0]))["fall"] == pytest.approx(-3.0)  # a loss that rose


def test_an_lr_rule_capped_at_a_plateau_says_so_not_a_measured_headroom():
    from tula_service.fit.perfmodel import EpochModel
    from tula_service.plan.advice import lr_rule

    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_lr": 0.1}))
    capped = lr_rule(spec, 128, EpochModel(32, 10.0, 2000.0, lr_headroom=1.0, lr_cap_why="the reference LR: the pilot's records are a plateau"))
    assert capped["lr"]["value"] == pytest.approx(0.1) and "capped at the reference LR: the pilot's records are a plateau" in capped["why"]
    measured = lr_rule(spec, 128, EpochModel(32, 10.0, 2000.0, lr_headroom=2.0))
    assert "capped at the measured stability headroom (2x the reference LR)" in measured["why"]


def test_the_pilot_and_initialization_evidence_say_which_weights_the_profiler_started_from(monkeypatch):
    """A fine-tuning spec's initial_weights are where the pilot and the points trained from; the evidence says so, and
    says a random init (with its seed) otherwise. The user's own reference run carries no such label."""
    pilot = _pilot_with_loss(lambda i: 2.303 - 0.02 * i)
    monkeypatch.setenv("TULA_DATA_ROOTS", "/data")
    for weights, said in ((None, "a random init (profiling.seed 0)"), ("/data/pretrained.pt", "initial_weights /data/pretrained.pt")):
        spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, initial_weights=weights, training={"reference_lr": 0.1}))
        candidates = plan(spec, [*POINTS, pilot])["models"]["efficiency"]["evidence"]["candidates"]
        started = {c["source"]: c["detail"].get("started_from") for c in candidates}
        assert started["pilot"] == said and started["initialization"] == said, weights
    with_reference = efficiency({"reference_run": {"gradient_stats": records(lambda s: 500.0)}})["evidence"]["candidates"]
    assert "started_from" not in with_reference[0]["detail"]
