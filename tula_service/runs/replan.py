"""Advice for a run's next interval, re-planned from its own telemetry (issue 17).

The run's live records enter the same code paths as measurements taken anywhere (tula_service.plan.recommend):

- Efficiency. The records with gradient statistics become gradient-statistics records (GradientStatsRecord:
  samples, global batch, |G|^2, tr(Sigma), variability) and replace `training.reference_run` in a copy of the
  job's spec, so the noise scale is read from the live trajectory by the estimator the service uses for a
  reference run (tula_service.fit.perfmodel.noise_trajectory: the progress-weighted mean over the second half
  of the run to the target, extrapolated by the trend while the run has not got there, and labelled so). AGS
  delta takes the live variability the same way. Only when the live trajectory is at least as strong as the
  job's own evidence: it covers at least the share of the run to the target that the job's reference run or
  pilot covered (records past the target do not count; a record counts where its statistics were taken,
  statistics_samples, not where its window ends: under TulaRun's sparse sampling the first window's statistics are
  the initial weights', and placed at its end they covered as much as a pilot's 10% and replaced it with an
  initialization read, moving a run 32 -> 16 in benchmarks/online.py). The run to the target is measured at the run's own
  batch b: E(b) D samples (efficiency_evidence.run_target_samples), not the reference run's
  T = reference_epochs x D, so that a run at a larger batch is read over the second half of its own run. Epochs measured at
  other batches (training.other_runs) are stronger than any trajectory and are kept; initial-weight
  statistics cover nothing and give way at once. Until then the job's evidence stays, and the answer says so:
  a run 10% of the way to the target that replaced a reference run logged to the target would swap a
  measured noise scale for an extrapolated one.
- Systems. The step times of the latest LIVE_WINDOW share of the records become one step measurement per
  (placement, per-device batch) (their median per micro-step, origin "live"), so the placement model is
  fitted to the run's real steps (a step on one device refits the compute model). A step with accumulation
  a on one device is a micro-steps of T_iter; on two or more devices it is left out (live_steps).
- The choice. The copy's cluster is the run's placement (its devices do not change within a run) and its
  objective min_time; of the candidates on the run's placement, the fastest to the target is compared with
  the run's current configuration, both predicted by the refitted models. The run moves to it only when
  the move saves at least `hysteresis` (default 5%) of the run's time to the target, and at least
  `min_steps_between_changes` optimizer steps have passed since the last change, and only when the saving holds
  over the noise scale's interval (recomputed at both of its ends; weak evidence without an interval does not
  move a run). The saving is the gain over the rest of the run times the share of the run left:
      saving = (1 - T_best / T_current) x (1 - samples done / (E_current D)),
  with T the predicted times to the target and E_current the predicted epochs at the current batch. A move late
  in a run saves little whatever its rate, and rests on the noise scale where the records end (the trend past
  them is an extrapolation): benchmarks/online.py saw runs moved 512 -> 256 at step 112-115 of about 120 take
  longer than the runs left alone. When the live trajectory has replaced the job's evidence, E_current is the
  smaller of the two models' epochs at the current batch until the run has done the job's (then the job's model is
  refuted and the live one stands alone): a live read that makes the current batch slower also makes the run look
  far from its end, and benchmarks/online.py saw mnist1d_cnn1d_adam moved 512 -> 128 at step 129, where its static
  runs ended at about 127, on a live model that put half the run ahead. A change says the last step it still pays at
  (apply_by_step: the step where the share left times the gain falls to the hysteresis), since the loop gets it
  later than the telemetry it rests on; a loop past that step keeps its configuration. A live
  estimate from a few records is noisy, and a run that follows every swing of it flaps between batches
  (benchmarks/online.py saw 128 -> 1024 and 128 -> 64 on the same task). The memory model bounds every
  candidate as in any plan. The LR follows the efficiency model's rule (AdaScale gain for the new global batch: r for SGD,
  sqrt(r) for Adam), and AGS delta and s are re-derived at the new batch.
- LR stability. The advised LR is capped at the stability headroom (tula_service.fit.efficiency_evidence:
  measured_lr_headroom), read relative to the reference LR (h x stability_lr / reference_lr, so a run whose LR
  the service raised reports its headroom at that LR and it still counts right). With the live trajectory in
  use, the live run's own measurements (TulaRun.measure_stability) in the second half of the run to the target
  win; without them, the job's headroom (its reference run or pilot) stands, since it is the same model's.

Each answer says what it is based on (records, live steps, the noise scale and its evidence), the predicted
gain, and why it changed or did not.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import numpy as np

from tula_service.fit.efficiency_evidence import epoch_model, measured_lr_headroom, samples_to_target, target_samples
from tula_service.fit.perfmodel.efficiency import EpochModel, max_step_gain
from tula_service.fit.perfmodel.noise_trajectory import statistics_position
from tula_service.measurement import PilotMeasurement, parse_measurement
from tula_service.plan.advice import ags_config, lr_rule
from tula_service.plan.recommend import measured_variability, plan, usable_measurements
from tula_service.runs.telemetry import TelemetryRecord
from tula_service.spec.job_spec import MAX_GRADIENT_STATS_RECORDS, JobSpec

LIVE_WINDOW = 0.5  # the latest share of the records whose step times say how fast the run is now
MIN_LIVE_STEPS = 3  # step-time records of one (placement, batch) before their median counts


def initial_config(recommendation: dict[str, Any]) -> dict[str, Any]:
    """The run's first configuration: the job's recommended choice, its LR and AGS."""
    chosen, advice = recommendation["chosen"], recommendation["training_advice"]
    return _config(chosen, advice["lr_rule"], advice["ags"], since_step=0, source="recommendation")


def _config(row: dict[str, Any], rule: dict[str, Any], ags: dict[str, Any], since_step: int, source: str) -> dict[str, Any]:
    return {
        "device_batch": row["device_batch"], "devices": row["devices"], "placement": row["placement"],
        "accumulation": row["accumulation"], "global_batch": row["global_batch"],
        "lr": rule.get("lr"), "lr_multiplier": rule["multiplier"], "lr_rule": rule["recommended"],
        "ags": {"delta": ags["delta"], "s": ags["s"]}, "since_step": since_step, "source": source,
    }  # fmt: skip


def gradient_records(records: list[TelemetryRecord], config: dict[str, Any]) -> list[dict[str, Any]]:
    """The records with both gradient statistics, as gradient-statistics records (the latest ones, at most
    MAX_GRADIENT_STATS_RECORDS). samples: the record's, else the steps times the global batch; statistics_samples, where
    the statistics were taken, is kept for the reader (noise_trajectory.statistics_position)."""
    out = []
    for record in records:
        if record.grad_sqr is None or record.trace_sigma is None:
            continue
        batch = _global_batch(record, config)
        entry = {"samples": record.samples if record.samples is not None else record.step * batch, "batch": batch,
                 "grad_sqr": record.grad_sqr, "trace_sigma": record.trace_sigma, "step": record.step}  # fmt: skip
        for name in ("loss", "metric", "variability", "precond_grad_sqr", "precond_trace_sigma", "stability_headroom", "stability_lr",
                     "statistics_samples"):
            if getattr(record, name) is not None:
                entry[name] = getattr(record, name)
        out.append(entry)
    return out[-MAX_GRADIENT_STATS_RECORDS:]


def _global_batch(record: TelemetryRecord, config: dict[str, Any]) -> int:
    device_batch = record.device_batch or config["device_batch"]
    devices = sum(record.placement) if record.placement else config["devices"]
    return device_batch * devices * (record.accumulation or config["accumulation"])


def live_steps(records: list[TelemetryRecord], config: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Step measurements of the latest LIVE_WINDOW of the records: the median seconds per micro-step of each
    (placement, per-device batch) where at least MIN_LIVE_STEPS were reported, and the number of records left
    out. With a accumulation steps, T_step = (a - 1) T_micro + T_iter (tula_service.fit.step_time); on one
    device there is no all-reduce, T_micro = T_iter, so a step of a micro-steps is a measurement of
    T_iter = T_step / a. On two or more devices the all-reduce in T_iter cannot be told apart from the
    micro-steps by the step's time alone: those records are left out (counted)."""
    window = records[int(len(records) * (1 - LIVE_WINDOW)) :]
    times: dict[tuple[tuple[int, ...], int], list[float]] = defaultdict(list)
    left_out = 0
    for record in window:
        if record.step_time_s is None:
            continue
        placement = tuple(record.placement or config["placement"])
        accumulation = record.accumulation or config["accumulation"]
        if accumulation != 1 and sum(placement) > 1:
            left_out += 1
            continue
        times[(placement, record.device_batch or config["device_batch"])].append(record.step_time_s / accumulation)
    steps = [
        {"kind": "step", "placement": list(placement), "device_batch": batch, "step_time_s": float(np.median(seconds)),
         "origin": "live", "records": len(seconds)}
        for (placement, batch), seconds in sorted(times.items()) if len(seconds) >= MIN_LIVE_STEPS
    ]  # fmt: skip
    return steps, left_out


def coverage(records: list[Any], target: float) -> float:
    """The share of the run to the target (target samples) that gradient-statistics records reach, each where its
    statistics were taken (noise_trajectory.statistics_position)."""
    reached = [statistics_position(r) for r in records]
    reached = [s for s in reached if s <= target]
    return min(1.0, max(reached) / target) if reached and target > 0 else 0.0


def job_evidence(spec: JobSpec, measurements: list[dict[str, Any]]) -> tuple[str, float]:
    """The job's strongest noise-scale evidence and the share of the run to the target it covers (infinite for
    epochs measured at other batches, 0 for the initial weights)."""
    if spec.training.other_runs:
        return "other_runs", float("inf")
    target = target_samples(spec)
    found = [("initialization", 0.0)]
    if spec.training.reference_run:
        found.append(("reference_run", coverage(list(spec.training.reference_run.gradient_stats), target)))
    pilots = _job_pilots(measurements)
    if pilots:
        found.append(("pilot", max(coverage(list(p.trajectory), target) for p in pilots)))
    return max(found, key=lambda item: item[1])


def live_spec(stored_spec: dict[str, Any], config: dict[str, Any], gradients: list[dict[str, Any]]) -> JobSpec:
    """The job's spec for re-planning the run: its cluster the run's placement, objective min_time, and the live
    gradient statistics as the reference run's trajectory."""
    data = copy.deepcopy(stored_spec)
    placement = config["placement"]
    data["cluster"] = {**data["cluster"], "nodes": len(placement), "gpus_per_node": max(placement)}
    data["objective"] = "min_time"
    data.setdefault("profiling", {})["step_placements"] = []  # profiling is over; they need not fit the placement
    if gradients:
        data["training"] = {**data["training"], "reference_run": {**(data["training"].get("reference_run") or {}), "gradient_stats": gradients}}
    return JobSpec.stored(data)


def advise(stored_spec: dict[str, Any], measurements: list[dict[str, Any]], failed: list[dict[str, Any]], run_options: dict[str, Any],
           config: dict[str, Any], stored_records: list[dict[str, Any]], last_step: int | None) -> dict[str, Any]:  # fmt: skip
    """The advice for the next interval; "change" holds the new configuration when the run should move."""
    records = [TelemetryRecord.model_validate(r) for r in stored_records]
    gradients, (steps, steps_left_out) = gradient_records(records, config), live_steps(records, config)
    job_spec = JobSpec.stored(stored_spec)
    job_source, job_coverage = job_evidence(job_spec, measurements)
    live_coverage = coverage(gradients, samples_to_target(gradients, job_spec)) if gradients else 0.0  # at the run's own batch
    use_live = bool(gradients) and live_coverage >= job_coverage
    spec = live_spec(stored_spec, config, gradients if use_live else [])
    job_headroom = measured_lr_headroom(job_spec, (_job_pilots(measurements) or [None])[-1]) if use_live else None
    planned = plan(spec, [*measurements, *steps], failed, earlier_headroom=job_headroom)
    here = [c for c in planned["candidates"] if c["placement"] == config["placement"]]
    current = next((c for c in here if (c["device_batch"], c["accumulation"]) == (config["device_batch"], config["accumulation"])), None)
    best = min(here, key=lambda c: c["total_time_s"]["value"]) if here else None
    step = last_step or 0
    since = step - config["since_step"]
    hysteresis, min_steps = run_options["hysteresis"], run_options["min_steps_between_changes"]
    gain = 1.0 - best["total_time_s"]["value"] / current["total_time_s"]["value"] if best and current else None
    done = max((float(r.samples) for r in records if r.samples is not None), default=0.0)  # samples the run has done
    left, left_why = _share_left(done, current, job_spec, _job_epochs(job_spec, measurements) if use_live else None)
    saving = gain * left if gain is not None else None
    efficiency = planned["models"]["efficiency"]
    epochs = _epoch_model(spec, efficiency)
    change = None
    if best is None or current is None:
        why = (f"the run's configuration (device batch {config['device_batch']}, accumulation {config['accumulation']} on "
               f"{config['placement']}) is not among the candidates the refitted models allow (memory): kept, as nothing "
               "better can be said")  # fmt: skip
    elif best is current or saving < hysteresis:
        why = (f"the best configuration on {config['placement']} is predicted {max(gain, 0.0):.1%} faster to the target"
               + (f" and {left:.0%} of the run is left{left_why}: it saves {max(saving, 0.0):.1%} of the run" if left < 1.0 else "")
               + f", below the {hysteresis:.0%} it takes to change: kept")  # fmt: skip
    elif (doubt := _doubt(spec, efficiency, best, current, hysteresis, left)) is not None:
        why = f"predicted {gain:.1%} faster at B_noise {efficiency['noise_scale']['value']:.3g}, but {doubt}: kept"
    elif since < min_steps:
        why = (f"predicted {gain:.1%} faster, but only {since} steps since the last change (at least {min_steps}): "
               "kept for now")  # fmt: skip
    else:
        variability = measured_variability(spec, usable_measurements([parse_measurement(m) for m in measurements])[0], None)
        rule = lr_rule(spec, best["global_batch"], epochs)
        change = _config(best, rule, ags_config(best["global_batch"], spec, epochs, variability), since_step=step, source="live")
        current_rule = lr_rule(spec, config["global_batch"], epochs)
        change["lr_relative_to_current"] = rule["multiplier"]["value"] / current_rule["multiplier"]["value"]
        change["apply_by_step"] = _apply_by_step(done, step, left, gain, hysteresis, config["global_batch"])
        why = (f"global batch {config['global_batch']} -> {best['global_batch']} (device batch {best['device_batch']}, "
               f"accumulation {best['accumulation']}): predicted {gain:.1%} faster to the target with {left:.0%} of the run "
               f"left{left_why}, a saving of {saving:.1%} of the run, at least the {hysteresis:.0%} it takes to change; "
               f"LR x{change['lr_relative_to_current']:.3g} ({rule['recommended']})"
               + (f"; apply it by step {change['apply_by_step']}, after which it saves less than {hysteresis:.0%}"
                  if change["apply_by_step"] is not None else ""))  # fmt: skip
    return {
        "step": last_step,
        "change": change,
        "why": why,
        "predicted": {
            "current_total_time_s": current["total_time_s"] if current else None,
            "best_total_time_s": best["total_time_s"] if best else None,
            "best": {k: best[k] for k in ("device_batch", "accumulation", "global_batch", "placement")} if best else None,
            "gain": gain, "share_of_run_left": left, "saving": saving, "hysteresis": hysteresis, "steps_since_change": since,
            "min_steps_between_changes": min_steps,
        },
        "evidence": {
            "telemetry_records": len(records),
            "gradient_records": len(gradients),
            "noise_scale": efficiency.get("noise_scale"),
            "noise_scale_from": "live trajectory" if use_live else f"the job's {job_source.replace('_', ' ')}",
            "noise_scale_why": (f"the live trajectory covers {live_coverage:.0%} of the run to the target, at least the "
                                f"{job_coverage:.0%} of the job's {job_source.replace('_', ' ')}") if use_live else
                               (f"the live trajectory covers {live_coverage:.0%} of the run to the target, less than the job's "
                                f"{job_source.replace('_', ' ')} ({'measured epochs' if job_coverage == float('inf') else f'{job_coverage:.0%}'}): "
                                "the job's noise scale is kept" + _sparse_statistics(len(gradients), len(records))),
            "noise_scale_evidence": (efficiency.get("evidence") or {}).get("used"),
            "lr_headroom": efficiency.get("lr_headroom"),
            "efficiency_warnings": efficiency.get("warnings", []),
            "live_steps": steps,
            "live_steps_left_out": steps_left_out,
            "live_steps_why": (f"{steps_left_out} step times with accumulation on two or more devices left out: their "
                               "all-reduce cannot be told apart from their micro-steps") if steps_left_out else None,
            "step_time_model": planned["models"]["step_time"]["model"],
        },
    }  # fmt: skip


def _sparse_statistics(with_statistics: int, records: int) -> str:
    """Why a live trajectory may stay short: when fewer than half the run's records carry gradient statistics, how many
    do, and the usual cause (TulaRun's overhead budget), so that the user knows where to look; "" otherwise."""
    if records == 0 or with_statistics >= records / 2:
        return ""
    return (f"; {with_statistics} of the run's {records} records carry gradient statistics: a client under an overhead budget "
            "takes them on fewer steps when its steps are short (TulaRun.overhead says its sampling period and whether the "
            "budget is met), and its statistics may then never reach the second half of the run")  # fmt: skip


def _share_left(done: float, current: dict[str, Any] | None, spec: JobSpec,
                job_epochs: EpochModel | None = None) -> tuple[float, str]:  # fmt: skip
    """(1 - samples done / (E_current D), why): the share of the run to the target still ahead at the current
    configuration's predicted epochs (module docstring, The choice; samples done at an earlier batch count as
    at this one); 1 before any record with samples, 0 past the prediction. job_epochs: the job's own epochs model,
    given when the live trajectory replaced the job's evidence; until the run has done the samples that model
    predicts at the current batch, the share left is the smaller of the two predictions (module docstring, The
    choice), and `why` names the job's when it is the one taken ("" otherwise). done: the samples the run has done
    (the records' largest)."""
    if current is None or done == 0.0:
        return 1.0, ""
    run_samples = float(current["epochs"]["value"]) * spec.dataset.num_samples
    left = min(1.0, max(0.0, 1.0 - done / run_samples)) if run_samples > 0 else 0.0
    if job_epochs is None or job_epochs.noise_scale is None:
        return left, ""
    job_samples = float(job_epochs.predict(current["global_batch"])) * spec.dataset.num_samples
    if not 0 < done < job_samples or 1.0 - done / job_samples >= left:
        return left, ""
    return 1.0 - done / job_samples, (f" by the job's own evidence (its {job_samples / spec.dataset.num_samples:.3g} epochs at this batch; "
                                      f"the live trajectory's {run_samples / spec.dataset.num_samples:.3g} leave {left:.0%})")  # fmt: skip


def _apply_by_step(done: float, step: int, left: float, gain: float, hysteresis: float, global_batch: int) -> int | None:
    """The last optimizer step (at the current global batch) at which the move still saves the hysteresis: with R =
    done / (1 - left) the run's predicted samples to the target, gain x (1 - s / R) >= hysteresis while the samples
    done s <= R (1 - hysteresis / gain). A loop that gets the advice later (its telemetry and its question travel
    while it trains: benchmarks/online.py saw a move decided at step 80 with 36% of the run left applied at step 133,
    past the end its static runs had) keeps its configuration. None before any samples are reported (no run length
    to count against). done: the samples the run has done."""
    if done <= 0.0 or left >= 1.0 or gain <= 0.0:
        return None
    last_samples = done / (1.0 - left) * (1.0 - hysteresis / gain)
    return step + max(0, int((last_samples - done) // global_batch))


def _job_epochs(spec: JobSpec, measurements: list[dict[str, Any]]) -> EpochModel:
    """The epochs model of the job's own evidence (its reference run, pilot or initialization), without the live
    trajectory: what the run was planned on."""
    ok = usable_measurements([parse_measurement(m) for m in measurements])[0]
    return epoch_model(spec, ok, (_job_pilots(measurements) or [None])[-1])[0]


def _doubt(spec: JobSpec, efficiency: dict[str, Any], best: dict[str, Any], current: dict[str, Any], hysteresis: float,
           left: float = 1.0) -> str | None:  # fmt: skip
    """Why the move to `best` does not hold over what the noise scale may be, or None when it holds: the saving
    recomputed at both ends of the noise scale's interval (each candidate's epochs E(B) at that B_noise times its
    predicted seconds per epoch; times `left`, the share of the run left) must reach the hysteresis too. Evidence
    labelled weak without an interval is doubt enough. Epochs fitted to runs at other batches (other_runs) are
    measured: the point gain stands."""
    noise = efficiency.get("noise_scale") or {}
    if noise.get("evidence") == "other_runs":
        return None
    interval = noise.get("interval")
    if not interval:
        return "the noise scale is weak evidence without an interval" if efficiency.get("weak") else None
    for end in interval:
        model = _epoch_model_at(spec, end, efficiency)
        seconds = [float(model.predict(c["global_batch"])) * c["total_time_s"]["value"] / c["epochs"]["value"] for c in (best, current)]
        saving = (1.0 - seconds[0] / seconds[1]) * left
        if saving < hysteresis:
            return (f"not at the other end of its interval [{interval[0]:.3g}, {interval[1]:.3g}] (at {end:.3g}: "
                    f"{saving:.1%} of the run)")  # fmt: skip
    return None


def _epoch_model(spec: JobSpec, efficiency: dict[str, Any]) -> EpochModel:
    """The refitted efficiency model, for the LR rule and AGS at a new batch."""
    return _epoch_model_at(spec, (efficiency.get("noise_scale") or {}).get("value"), efficiency)


def _job_pilots(measurements: list[dict[str, Any]]) -> list[PilotMeasurement]:
    """The job's successful pilots, in order (plan() reads the latest)."""
    return [parse_measurement(m) for m in measurements if m.get("kind") == "pilot" and m.get("status", "ok") == "ok"]


def _epoch_model_at(spec: JobSpec, noise_scale: float | None, efficiency: dict[str, Any]) -> EpochModel:
    """The spec's epochs model at a given B_noise (E_min from the reference run), with the LR stability headroom
    the refitted efficiency model read (the live run's, else the job's: module docstring)."""
    training = spec.training
    headroom = efficiency.get("lr_headroom")
    return EpochModel(training.reference_batch, training.reference_epochs, noise_scale,
                      max_step_gain(training.optimizer, training.reference_lr, training.max_lr), optimizer=training.optimizer,
                      lr_headroom=headroom["value"] if headroom else None,
                      lr_cap_why=(headroom or {}).get("cap_why"))  # fmt: skip
