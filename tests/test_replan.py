"""Re-planning a run (tula_service.runs.replan.advise) on hand-made evidence: the live trajectory replaces the
job's noise-scale evidence only once it covers as much of the run to the target, and the answer says which
evidence it used."""

import pytest

from tests.handmade import measurement, spec_dict
from tula_service.plan.recommend import plan
from tula_service.runs.replan import advise, initial_config
from tula_service.runs.telemetry import DEFAULT_HYSTERESIS
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128]
TARGET_SAMPLES = 10 * 50_000  # reference_epochs x num_samples of the hand-made spec
OPTIONS = {"hysteresis": DEFAULT_HYSTERESIS, "min_steps_between_changes": 0}


def _reference_run(noise_scale: float, last: float = TARGET_SAMPLES) -> list[dict]:
    return [{"samples": int(last * (i + 1) / 20), "batch": 32, "grad_sqr": 1.0, "trace_sigma": noise_scale} for i in range(20)]


def _job(**training) -> tuple[dict, list[dict], dict]:
    spec = spec_dict(batch_sizes=BATCHES, objective="min_time", training={"reference_lr": 0.1, **training})
    points = [measurement(b) for b in BATCHES]
    recommendation = plan(JobSpec.model_validate(spec), points)
    return JobSpec.model_validate(spec).model_dump(mode="json"), points, initial_config(recommendation)


def _live(config: dict, last_samples: float, noise_scale: float, records: int = 40) -> list[dict]:
    batch = config["global_batch"]
    steps = [max(1, round(last_samples * (i + 1) / records / batch)) for i in range(records)]
    return [{"step": s, "samples": s * batch, "grad_sqr": 1.0, "trace_sigma": noise_scale, "step_time_s": 0.05} for s in sorted(set(steps))]


def test_a_short_live_trajectory_does_not_replace_a_reference_run_logged_to_the_target():
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0)})
    records = _live(config, 0.1 * TARGET_SAMPLES, 5000.0)
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    evidence = advice["evidence"]
    assert evidence["noise_scale_from"] == "the job's reference run" and "less than" in evidence["noise_scale_why"]
    assert evidence["noise_scale"]["value"] == pytest.approx(100.0, rel=0.05) and advice["change"] is None


def test_a_live_trajectory_as_long_as_the_reference_run_replaces_it():
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0, last=0.5 * TARGET_SAMPLES)})
    records = _live(config, 0.6 * TARGET_SAMPLES, 5000.0)
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    assert advice["evidence"]["noise_scale_from"] == "live trajectory"
    assert advice["evidence"]["noise_scale"]["value"] == pytest.approx(5000.0, rel=0.05)
    assert advice["change"] is not None and advice["change"]["global_batch"] > config["global_batch"]


def test_a_move_late_in_the_run_must_save_the_hysteresis_of_the_whole_run():
    """The same rate gain moves a run with most of it ahead and keeps one near its end: the saving is the gain times
    the share of the run left (1 - samples done / predicted samples to the target at the current batch)."""
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0, last=0.5 * TARGET_SAMPLES)})
    answers = {}
    for share in (0.6, 0.97):
        records = _live(config, share * TARGET_SAMPLES, 5000.0)
        answers[share] = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    early, late = answers[0.6], answers[0.97]
    assert early["predicted"]["gain"] == pytest.approx(late["predicted"]["gain"], rel=0.05) and late["predicted"]["gain"] > DEFAULT_HYSTERESIS
    assert early["predicted"]["share_of_run_left"] == pytest.approx(0.4, abs=0.02) and early["change"] is not None
    assert late["predicted"]["share_of_run_left"] == pytest.approx(0.03, abs=0.02) and late["change"] is None
    assert late["predicted"]["saving"] < DEFAULT_HYSTERESIS and "of the run is left" in late["why"] and "kept" in late["why"], late["why"]


def test_a_live_read_that_puts_the_run_far_from_its_end_moves_it_only_once_it_has_passed_the_jobs_prediction():
    """A live noise scale below the job's makes the current batch slower and the run look far from its end: until the
    run has done the samples the job's own model predicts at its batch, the share left is the smaller of the two
    predictions (benchmarks/online.py saw a run moved 512 -> 128 at step 129 of its static runs' 127)."""
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(1000.0, last=0.1 * TARGET_SAMPLES)})
    answers = {}
    for share in (1.0, 1.15):  # of the reference run's samples; the job predicts 10.9 epochs at 128, the live read 28.5
        records = _live(config, share * TARGET_SAMPLES, 20.0)
        answers[share] = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    near_end, past = answers[1.0], answers[1.15]
    assert near_end["evidence"]["noise_scale_from"] == "live trajectory" and near_end["predicted"]["gain"] > 0.2
    assert near_end["predicted"]["share_of_run_left"] == pytest.approx(1 - 10 / 10.9, abs=0.02) and near_end["change"] is None
    assert "by the job's own evidence" in near_end["why"] and "kept" in near_end["why"], near_end["why"]
    assert past["predicted"]["share_of_run_left"] == pytest.approx(1 - 11.5 / 28.5, abs=0.03)
    assert past["change"] is not None and past["change"]["global_batch"] < config["global_batch"], past["why"]
    assert "job's own evidence" not in past["why"]


def test_a_change_says_the_last_step_it_still_saves_the_hysteresis_at():
    """The loop gets an answer after the telemetry it rests on (benchmarks/online.py saw a move decided at step 80 with
    36% of the run left applied at step 133): apply_by_step is where the share left times the gain falls to the
    hysteresis, counted at the current global batch."""
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0, last=0.5 * TARGET_SAMPLES)})
    records = _live(config, 0.6 * TARGET_SAMPLES, 5000.0)
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    change, predicted = advice["change"], advice["predicted"]
    assert change is not None and f"apply it by step {change['apply_by_step']}" in advice["why"]
    done = records[-1]["samples"]
    run_samples = done / (1 - predicted["share_of_run_left"])
    at_limit = change["apply_by_step"] * config["global_batch"]  # the samples done there, at the current batch
    assert predicted["gain"] * (1 - at_limit / run_samples) == pytest.approx(DEFAULT_HYSTERESIS, abs=config["global_batch"] / run_samples)
    assert change["apply_by_step"] > records[-1]["step"]


def test_the_live_runs_stability_headroom_caps_the_lr_it_moves_to_and_without_one_the_jobs_stands():
    """The live trajectory replaces the job's reference run for the noise scale; the LR cap comes from the live
    run's own headroom in the second half (read relative to the reference LR), else from the job's."""
    reference = _reference_run(100.0, last=0.5 * TARGET_SAMPLES)
    for record in reference[-3:]:
        record.update(stability_headroom=1.7, stability_lr=0.1)
    spec, points, config = _job(reference_run={"gradient_stats": reference})
    records = _live(config, 0.6 * TARGET_SAMPLES, 5000.0)
    options = {**OPTIONS, "hysteresis": 0.01}  # the capped LR's move saves 4.1% of the run, 40% of it left: moved all the same
    advice = advise(spec, points, [], options, config, records, records[-1]["step"])
    assert advice["evidence"]["noise_scale_from"] == "live trajectory" and advice["change"] is not None
    job_cap = advice["evidence"]["lr_headroom"]
    assert job_cap["value"] == pytest.approx(1.7) and job_cap["evidence"].startswith("the job's: reference_run, second half")
    assert advice["change"]["lr_multiplier"]["value"] == pytest.approx(1.7)  # AdaScale at B_noise 5000 asks for 1.99
    for record in records[-5:]:  # the live run measured at half the reference LR: 3 x 0.05 is 1.5x the reference LR
        record.update(stability_headroom=3.0, stability_lr=0.05)
    live = advise(spec, points, [], options, config, records, records[-1]["step"])
    assert live["evidence"]["lr_headroom"]["value"] == pytest.approx(1.5) and live["evidence"]["lr_headroom"]["evidence"].startswith("reference_run, second half: 5 records")
    assert live["change"]["lr_multiplier"]["value"] == pytest.approx(1.5)


def test_statistics_at_the_initial_weights_give_way_to_the_first_live_records():
    spec, points, config = _job()
    records = _live(config, 0.02 * TARGET_SAMPLES, 5000.0)
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    assert advice["evidence"]["noise_scale_from"] == "live trajectory"


def test_a_live_record_whose_statistics_are_the_initial_weights_does_not_count_as_the_window_it_closes():
    """Under TulaRun's sparse sampling a window's statistics come from its first two steps: the first window's from the
    initial weights, though the record closes the window further on. Placed at the window's end, such a record covered
    as much of the run as a pilot's 10% and replaced it with an initialization read (benchmarks/online.py saw a run moved
    32 -> 16 that way, and take 1.04x the time); placed where its statistics were taken (statistics_samples), it does
    not."""
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0, last=0.1 * TARGET_SAMPLES)})
    batch = config["global_batch"]
    step = round(0.11 * TARGET_SAMPLES / batch)
    window_end = {"step": step, "samples": step * batch, "grad_sqr": 1.0, "trace_sigma": 1.0, "step_time_s": 0.05}
    placed = {**window_end, "statistics_samples": round(1.5 * batch)}  # the mean of steps 0 and 1
    kept = advise(spec, points, [], OPTIONS, config, [placed], step)["evidence"]
    assert kept["noise_scale_from"] == "the job's reference run" and kept["noise_scale"]["value"] == pytest.approx(100.0, rel=0.05)
    assert "covers 0% of the run" in kept["noise_scale_why"]
    taken = advise(spec, points, [], OPTIONS, config, [window_end], step)["evidence"]  # what the same record did at its window's end
    assert taken["noise_scale_from"] == "live trajectory"


def test_epochs_measured_at_other_batches_are_never_replaced():
    spec, points, config = _job(other_runs=[{"batch": 256, "epochs": 12.0}])
    records = _live(config, TARGET_SAMPLES, 5000.0)
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    assert advice["evidence"]["noise_scale_from"] == "the job's other runs" and "measured epochs" in advice["evidence"]["noise_scale_why"]


def test_a_gain_that_does_not_hold_over_the_noise_scales_interval_keeps_the_run():
    spec, points, config = _job()
    records = _live(config, 0.4 * TARGET_SAMPLES, 1.0, records=4)
    for i, record in enumerate(records):  # four records that swing 100x: B_noise about 1000, known to 2x at best
        record["trace_sigma"] = 2000.0 if i % 2 else 20.0
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    low, high = advice["evidence"]["noise_scale"]["interval"]
    assert high / low > 2 and advice["predicted"]["gain"] >= DEFAULT_HYSTERESIS and advice["change"] is None
    assert "not at the other end of its interval" in advice["why"] and "kept" in advice["why"], advice["why"]
    steady = _live(config, 0.4 * TARGET_SAMPLES, 1010.0, records=4)  # the same level measured steadily: it moves
    assert advise(spec, points, [], OPTIONS, config, steady, steady[-1]["step"])["change"] is not None


def test_live_steps_with_accumulation_on_one_device_count_per_micro_step_and_on_several_are_left_out():
    from tula_service.runs.replan import live_steps
    from tula_service.runs.telemetry import TelemetryRecord

    config = {"placement": [1], "device_batch": 16, "accumulation": 2}
    one = [TelemetryRecord.model_validate({"step": s, "samples": 32 * s, "step_time_s": 0.2}) for s in range(1, 9)]
    steps, left_out = live_steps(one, config)
    # T_step = (a - 1) T_micro + T_iter and T_micro = T_iter on one device: 0.2 s over 2 micro-steps
    assert left_out == 0 and steps == [{"kind": "step", "placement": [1], "device_batch": 16, "step_time_s": pytest.approx(0.1),
                                        "origin": "live", "records": 4}]  # the latest half of the records
    several = [TelemetryRecord.model_validate({"step": s, "samples": 64 * s, "step_time_s": 0.2, "placement": [2], "accumulation": 2,
                                               "device_batch": 16}) for s in range(1, 9)]  # fmt: skip
    assert live_steps(several, config) == ([], 4)
    plain = [TelemetryRecord.model_validate({**r.model_dump(), "accumulation": 1}) for r in several]
    assert live_steps(plain, config)[0][0]["step_time_s"] == pytest.approx(0.2)


def test_a_run_at_a_larger_batch_is_read_over_its_own_run_to_the_target():
    """A run at 4 x the reference batch needs more samples to the target than the reference run: its noise scale
    (growing along the run here) is read over the second half of its own run, not over the reference run's samples,
    where it would read the run's first part and move it to a smaller batch late in training (benchmarks/online.py)."""
    from tula_service.fit.perfmodel.noise_trajectory import TrajectoryNoiseScale

    spec, points, config = _job()
    config = {**config, "device_batch": 128, "global_batch": 128, "accumulation": 1}
    steps = sorted({round(2 * TARGET_SAMPLES * (i + 1) / 60 / 128) for i in range(60)})
    records = [{"step": s, "samples": s * 128, "grad_sqr": 1.0, "trace_sigma": 100.0 * s * 128 / TARGET_SAMPLES, "step_time_s": 0.05}
               for s in steps]  # fmt: skip
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    read = advice["evidence"]["noise_scale"]["value"]
    assert advice["evidence"]["noise_scale_from"] == "live trajectory"
    as_reference_run = TrajectoryNoiseScale().fit([{**r, "batch": 128} for r in records], TARGET_SAMPLES).noise_scale_
    assert read > 1.5 * as_reference_run
    own_run = 10 * (1 + 128 / read) / (1 + 32 / read) * 50_000  # E(128) D at the read: the run it was read over
    assert TARGET_SAMPLES < own_run < 2 * TARGET_SAMPLES
    covered = max(r["samples"] for r in records if r["samples"] <= own_run) / own_run  # records past the target do not count
    assert f"covers {covered:.0%} of the run to the target" in advice["evidence"]["noise_scale_why"]


def test_a_run_at_a_larger_batch_caps_the_lr_with_the_headroom_of_the_second_half_of_its_own_run():
    spec, points, config = _job()
    config = {**config, "device_batch": 128, "global_batch": 128, "accumulation": 1}
    steps = sorted({round(2 * TARGET_SAMPLES * (i + 1) / 60 / 128) for i in range(60)})
    records = [{"step": s, "samples": s * 128, "grad_sqr": 1.0, "trace_sigma": 100.0 * s * 128 / TARGET_SAMPLES, "step_time_s": 0.05}
               for s in steps]  # fmt: skip
    early = min(records, key=lambda r: abs(r["samples"] - 0.6 * TARGET_SAMPLES))  # the reference run's second half, its own first
    late = min(records, key=lambda r: abs(r["samples"] - 1.8 * TARGET_SAMPLES))
    early.update(stability_headroom=1.2, stability_lr=0.1)
    late.update(stability_headroom=2.5, stability_lr=0.1)
    advice = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])
    headroom = advice["evidence"]["lr_headroom"]
    assert headroom["value"] == pytest.approx(2.5) and headroom["evidence"].startswith("reference_run, second half: 1 records")


def test_a_live_trajectory_kept_short_by_sparse_statistics_says_so():
    """A client under an overhead budget on short steps sends most records without gradient statistics (TulaRun
    samples 2 steps in up to 1024); the answer that keeps the job's noise scale names how many records had them."""
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0)})
    records = _live(config, 0.1 * TARGET_SAMPLES, 5000.0)
    sparse = [r if i < 3 else {k: v for k, v in r.items() if k not in ("grad_sqr", "trace_sigma")} for i, r in enumerate(records)]
    why = advise(spec, points, [], OPTIONS, config, sparse, sparse[-1]["step"])["evidence"]["noise_scale_why"]
    assert f"3 of the run's {len(sparse)} records carry gradient statistics" in why and "overhead budget" in why
    dense = advise(spec, points, [], OPTIONS, config, records, records[-1]["step"])["evidence"]["noise_scale_why"]
    assert "less than" in dense and "carry gradient statistics" not in dense


def test_a_live_run_whose_loss_has_not_fallen_is_not_moved_by_its_plateau_noise_scale():
    """The live trajectory read where the loss is flat (a plateau: efficiency_evidence.plateau_cap) keeps the LR at
    the reference, and a larger batch at that LR is no faster: the run is kept, and says why; the same records with a
    falling loss move it."""
    spec, points, config = _job(reference_run={"gradient_stats": _reference_run(100.0, last=0.5 * TARGET_SAMPLES)})
    records = _live(config, 0.6 * TARGET_SAMPLES, 5000.0)
    flat = [{**r, "loss": 2.303} for r in records]
    falling = [{**r, "loss": 2.303 / (1 + i / 10)} for i, r in enumerate(records)]
    kept = advise(spec, points, [], OPTIONS, config, flat, flat[-1]["step"])
    moved = advise(spec, points, [], OPTIONS, config, falling, falling[-1]["step"])
    assert kept["evidence"]["noise_scale_from"] == "live trajectory" and kept["change"] is None
    assert kept["evidence"]["lr_headroom"]["value"] == 1.0 and "a plateau" in kept["evidence"]["lr_headroom"]["evidence"]
    assert moved["change"] is not None and moved["change"]["global_batch"] > config["global_batch"]
