"""Measurements + spec -> recommendation. A pure function: re-planning needs no new profiling.

Every number in the result carries where it came from:
- "measured": read from a profiling point as is;
- "fitted": a model parameter, with its fit quality (R^2, leave-one-out relative error, std. error);
- "predicted": computed from fitted models (its error is the models' leave-one-out error);
- "spec": given by the user; "assumed": a stated default in place of a measurement.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import numpy as np

from tula_service.dispatch.maxbatch import bracket
from tula_service.dispatch.reliability import assess, quieter
from tula_service.fit.efficiency_evidence import target_samples
from tula_service.fit.fitting import FittedModels, NotEnoughSteps, fit_models
from tula_service.fit.perfmodel.efficiency import EpochModel, adascale_gain, lr_multiplier_of_gain
from tula_service.measurement import (
    CommMeasurement, ComputeMeasurement, Measurement, PilotMeasurement, StepMeasurement, parse_measurement,
)  # fmt: skip
from tula_service.plan.advice import ags_config, lr_rule, runner_ups, warmup
from tula_service.plan.knee import KNEE_METHODS
from tula_service.plan.planner import (
    ACCUMULATION_STEPS,
    MEMORY_MARGIN,
    PLACEMENT_KINDS,
    PlanInputs,
    choose,
    gpus_on_nodes,
    max_device_batch,
    ranking,
    sweep,
)  # fmt: skip
from tula_service.plan.schedule import NoiseProfile, batch_schedule, flat_profile, noise_profile
from tula_service.spec.job_spec import JobSpec, powers_of_two_between
from tula_service.units import GIB


class NotEnoughMeasurements(ValueError):
    """Fewer than two usable points: a line cannot be fitted."""


Record = TypeVar("Record", bound=dict[str, Any] | Measurement)  # a stored record, or a parsed one


def usable_measurements(measurements: list[Record]) -> tuple[list[Record], list[int]]:
    """Successful compute points (one per batch size: of a re-timed batch the quieter measurement,
    tula_service.dispatch.reliability) and the batches that ran out of memory. The points are the records it was
    given: parsed measurements for parsed ones (as `plan` passes them), stored dicts for stored ones."""
    ok_by_batch: dict[int, tuple[ComputeMeasurement, Record]] = {}
    oom_batches: set[int] = set()
    for record in measurements:
        point = parse_measurement(record)
        if not isinstance(point, ComputeMeasurement) or point.kind != "compute":
            continue
        if point.ok:
            earlier = ok_by_batch.get(point.batch_size)
            if earlier is None or quieter(earlier[0], point) is point:
                ok_by_batch[point.batch_size] = (point, record)
        elif point.status == "oom":
            oom_batches.add(point.batch_size)
    return [ok_by_batch[b][1] for b in sorted(ok_by_batch)], sorted(oom_batches)


def measured_reach(steps: list[StepMeasurement], comm: CommMeasurement | None) -> dict[str, int]:
    """How far the multi-device measurements reach: the most devices (a measured step's, or the all-reduce
    benchmark's largest world size), nodes and GPUs on one node of a measured multi-device step (1 where none
    was measured: every node is then beyond them)."""
    multi = [s for s in steps if s.devices > 1]
    world_sizes = [p.world_size for p in comm.points] if comm is not None else []
    return {
        "devices": max([1, *world_sizes, *(s.devices for s in multi)]),
        "nodes": max([1, *(len(s.placement) for s in multi)]),
        "gpus_per_node": max([1, *(max(s.placement) for s in multi)]),
    }


def beyond_reach(placement: list[int], reach: dict[str, int]) -> list[str]:
    """What of a multi-device candidate's placement lies beyond the measurements (measured_reach): "devices",
    "nodes", "gpus_per_node"; its step time there is an extrapolation of the step-time model, not an
    interpolation. Empty on one device (the compute points time it)."""
    if sum(placement) == 1:
        return []
    size = {"devices": sum(placement), "nodes": len(placement), "gpus_per_node": max(placement)}
    return [part for part in ("devices", "nodes", "gpus_per_node") if size[part] > reach[part] and (part == "devices" or size[part] > 1)]


def candidate_device_batches(ok_batches: list[int], oom_batches: list[int]) -> np.ndarray:
    """Powers of two inside the profiled range (and the profiled sizes), below the smallest OOM batch."""
    low, high = min(ok_batches), max(ok_batches)
    values = set(powers_of_two_between(low, high)) | set(ok_batches)
    if oom_batches:
        values = {v for v in values if v < min(oom_batches)}
    return np.array(sorted(values))


def plan(spec: JobSpec, measurements: list[dict[str, Any]], failed_points: list[dict[str, Any]] | None = None,
         earlier_headroom: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The recommendation of a job's stored measurements (parsed here, once: tula_service.measurement);
    earlier_headroom: the job's LR stability headroom when a run is re-planned (tula_service.runs.replan)."""
    points = [parse_measurement(m) for m in measurements]
    ok, oom_batches = usable_measurements(points)
    steps = [m for m in points if isinstance(m, StepMeasurement) and m.ok]  # an out-of-memory step has no times
    single_step_batches = sorted({s.device_batch for s in steps if s.devices == 1})
    if len(ok) < 2 and (ok or len(single_step_batches) < 2):
        raise NotEnoughMeasurements(
            f"need at least 2 successfully profiled batch sizes, got {len(ok)}"
            + (f" (out of memory at {oom_batches})" if oom_batches else "")
            + ("" if ok else f", or steps on one GPU at 2 or more batches, got {len(single_step_batches)}")
        )
    if not ok and spec.pricing.kind == "memory_gb_hour":
        raise NotEnoughMeasurements("memory_gb_hour pricing bills the memory used, and steps alone do not measure it: give compute measurements")
    comm = next((m for m in points if isinstance(m, CommMeasurement) and m.ok), None)
    pilot = next((m for m in reversed(points) if isinstance(m, PilotMeasurement) and m.ok), None)
    try:
        models, report = fit_models(spec, ok, comm, pilot, steps, earlier_headroom)
    except NotEnoughSteps as error:
        raise NotEnoughMeasurements(str(error)) from None
    timed_batches = [m.batch_size for m in ok] or single_step_batches
    inputs = PlanInputs(
        device_batches=candidate_device_batches(timed_batches, oom_batches),
        total_devices=spec.cluster.total_devices,
        device_memory_bytes=spec.cluster.device_memory_gib * GIB,
        num_samples=spec.dataset.num_samples,
        pricing_kind=spec.pricing.kind,
        price=spec.pricing.price,
        gpus_per_node=spec.cluster.gpus_per_node,
        fixed_overhead_usd=spec.pricing.fixed_overhead_usd,
        nodes=spec.cluster.nodes,
    )
    candidates = sweep(models, inputs)
    if candidates["global_batch"].size == 0:
        raise NotEnoughMeasurements(
            f"no profiled batch fits in {spec.cluster.device_memory_gib} GiB per device "
            f"(static memory alone is {getattr(models.memory, 'static_bytes_', float('nan')) / GIB:.2f} GiB)"
        )
    choice = choose(candidates, spec.objective, spec.deadline_h, spec.budget_usd)
    chosen, knee, front = choice.index, choice.knee, choice.front
    measured = {m.batch_size: m for m in ok}
    step_err = report["step_time"].get("held_out_median_rel_err")
    measured_steps = {(tuple(s.placement), s.device_batch): s.step_time_s for s in steps}
    reach = measured_reach(steps, comm)
    rows = [_candidate_row(candidates, i, front, measured, report, step_err, measured_steps) for i in range(candidates["global_batch"].size)]
    _mark_epochs_intervals(rows, models.epochs, spec.pricing.fixed_overhead_usd)
    _mark_given_epochs(rows, models.epochs)
    for row in rows:
        row["extrapolated"] = beyond_reach(row["placement"], reach)
    tokens_per_sample = ok[0].model.tokens_per_sample if ok else None
    if tokens_per_sample:  # language models: a batch is counted in sequences and in tokens
        for row in rows:
            row["global_batch_tokens"] = row["global_batch"] * tokens_per_sample
    max_batch = max_device_batch(models.memory, inputs.device_memory_bytes)
    noise_scale = report["efficiency"]["noise_scale"]["value"] if report["efficiency"]["source"] == "fitted" else None
    variability = measured_variability(spec, ok, pilot)
    return {
        "objective": spec.objective,
        "constraint": choice.constraint,
        "training_advice": {
            "lr_rule": lr_rule(spec, rows[chosen]["global_batch"], models.epochs),
            "warmup": warmup(spec, rows[chosen]),
            "batch_schedule": batch_schedule(noise_profile_of(spec, pilot, report["efficiency"]), rows, rows[chosen], noise_scale,
                                             spec.training.reference_epochs, spec.training.reference_batch, spec.dataset.num_samples,
                                             lambda batch, noise: stage_lr_multiplier(spec, models.epochs, batch, noise),
                                             models.epochs.cap_gain() if models.epochs.lr_headroom is not None else None),
            "ags": ags_config(rows[chosen]["global_batch"], spec, models.epochs, variability),
        },
        "runner_ups": runner_ups(rows, chosen, ranking(candidates, spec.objective, front, rows[chosen]["global_batch"])),
        "batch_unit": {"unit": "sequences" if tokens_per_sample else "samples", "tokens_per_sample": tokens_per_sample},
        "chosen": rows[chosen],
        "knee": None
        if knee is None
        else {
            "global_batch": knee.global_batch,
            "method": knee.method,
            "method_explained": KNEE_METHODS[knee.method],
            "sensitivity": knee.sensitivity,
            "curve": "pareto front: log2 total time vs log2 global batch",
            "candidate": chosen,  # its index in candidates: a knee exists only under objective "knee", which picks it
        },
        "candidates": rows,
        "pareto_front": [i for i in range(len(rows)) if front[i]],
        "pricing": {
            "kind": spec.pricing.kind,
            "price": {"value": spec.pricing.price, "source": spec.pricing.price_source},
            "fixed_overhead_usd": {"value": spec.pricing.fixed_overhead_usd, "source": "spec"},
        },
        "device": {
            "gpu_type": spec.cluster.gpu_type,
            "memory_gib": {"value": spec.cluster.device_memory_gib, "source": spec.cluster.device_memory_source},
        },
        "models": report,
        "curves": model_curves(models, report, spec, timed_batches, oom_batches, max_batch, rows),
        "reliability": assess(ok, report["compute"]["leave_one_out"], _retimed_batches(points)),
        "search_space": {
            "device_batches": [int(b) for b in inputs.device_batches],
            "max_device_batch": {"value": max_batch, "source": "predicted" if ok else "assumed"},
            "memory_margin": {"value": MEMORY_MARGIN, "source": "assumed"},
            "devices": sorted({int(n) for n in candidates["devices"]}),
            "accumulation_steps": list(ACCUMULATION_STEPS),
            "chosen_at_edge": chosen_at_edge(rows, chosen, spec.objective, spec.training.reference_batch),
        },
        "profiled": {
            "ok_batches": sorted(timed_batches),
            "oom_batches": oom_batches,
            "memory_limit": _measured_limit(sorted(timed_batches), oom_batches),
            "failed": failed_points or [],
            "points": [_point_summary(m) for m in ok],
        },
    }


CURVE_POINTS = 80  # per curve: smooth on a log axis, a few KB of JSON
CURVE_DIGITS = 4  # significant digits of a curve's batches; the models are evaluated at the rounded batches


def log_grid(low: float, high: float, points: int = CURVE_POINTS) -> np.ndarray:
    """`points` batches evenly spaced in log from low to high (both included), to CURVE_DIGITS digits."""
    return np.array([float(f"{batch:.{CURVE_DIGITS}g}") for batch in np.geomspace(low, high, points)])


def model_curves(
    models: FittedModels, report: dict[str, Any], spec: JobSpec, ok_batches: list[int], oom_batches: list[int],
    max_batch: int, rows: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The fitted models evaluated for drawing, by the objects the sweep uses, so a curve cannot drift from the plan.

    Each curve is parallel lists named with their unit, plus where the values come from (as a candidate's):
    - iter_time: one device, T_iter(b) = T_comp(b) (no communication), and b / T_iter(b), over the profiled
      batches +- 25%;
    - memory: M(b) and the upper end of its 95% prediction interval (what the max batch must fit), up to
      past the max batch and the out-of-memory batches;
    - epochs: E(B) over the candidates' global batches, the reference and other runs and B_noise, 2x either side,
      with its calibrated band (calibrated_low, calibrated_high) when there is one.
    """
    low, high = min(ok_batches) / 1.25, max(ok_batches) * 1.25
    device_batch = log_grid(low, high)
    iter_time_s = models.overlap.combine(models.compute.predict(device_batch), models.network.predict(1))
    memory_batch = log_grid(low, max(high, 1.5 * max_batch, *(1.25 * b for b in oom_batches)))
    memory_bytes, memory_upper_bytes = models.memory.predict(memory_batch), models.memory.predict_interval(memory_batch)[1]
    efficiency = report["efficiency"]
    noise_scale = [efficiency["noise_scale"]["value"]] if efficiency["noise_scale"] else []
    around = [*(row["global_batch"] for row in rows), spec.training.reference_batch, *noise_scale,
              *(run.batch for run in spec.training.other_runs)]  # fmt: skip
    global_batch = log_grid(min(around) / 2, max(around) * 2)
    return {
        "iter_time": {
            "device_batch": device_batch.tolist(),
            "iter_time_s": iter_time_s.tolist(),
            "samples_per_s": (device_batch / iter_time_s).tolist(),
            "devices": 1,
            "model": report["compute"]["name"],
            "formula": report["compute"]["formula"],
            "source": "predicted",
            "rel_err": report["compute"]["leave_one_out"]["median_rel_err"],
        },
        "memory": None
        if report["memory"]["source"] == "assumed"
        else {
            "device_batch": memory_batch.tolist(),
            "memory_bytes": memory_bytes.tolist(),
            "memory_upper_bytes": memory_upper_bytes.tolist(),
            "formula": report["memory"]["formula"],
            "source": "predicted",
            "rel_err": report["memory"]["leave_one_out"]["median_rel_err"],
        },
        "epochs": {
            "global_batch": global_batch.tolist(),
            "epochs": models.epochs.predict(global_batch).tolist(),
            "formula": efficiency["formula"],
            "source": "assumed" if efficiency["source"] == "assumed" else "predicted",
            **_calibrated_band(models.epochs, global_batch),
        },
    }


def _calibrated_band(epochs: Any, global_batch: np.ndarray) -> dict[str, list[float]]:
    """The epochs curve's calibrated band (EpochModel.interval at each batch), when the model has one (EpochModel.banded)."""
    if not getattr(epochs, "banded", False):
        return {}
    ends = [epochs.interval(float(batch)) for batch in global_batch]
    if any(end is None for end in ends):
        return {}
    return {"calibrated_low": [end[0] for end in ends], "calibrated_high": [end[1] for end in ends]}


def _retimed_batches(points: list[Measurement]) -> list[int]:
    """Batches with more than one successful compute measurement: timed again (tula_service.dispatch.reliability)."""
    batches = [m.batch_size for m in points if isinstance(m, ComputeMeasurement) and m.kind == "compute" and m.ok]
    return sorted({b for b in batches if batches.count(b) > 1})


def measured_variability(
    spec: JobSpec, ok: list[ComputeMeasurement | dict[str, Any]], pilot: PilotMeasurement | dict[str, Any] | None
) -> dict[str, Any]:
    """Gradient variability with the batch it was measured at: along the reference run, else the pilot
    (both at training.reference_batch, through training), else the profiled points (at initialization).
    Takes parsed measurements or stored records."""
    reference = spec.training.reference_run
    pilot_records = parse_measurement(pilot).trajectory if pilot is not None else []
    trajectories = (("reference run", list(reference.gradient_stats) if reference else []), ("pilot", pilot_records))
    for source, records in trajectories:
        values = [(r.variability, r.batch) for r in records if r.variability is not None]
        if values:
            return {"values": values, "source": source}
    gradients = [m.gradient for m in map(parse_measurement, ok) if m.gradient]
    values = [(v, gradient.batch) for gradient in gradients for v in gradient.variability_series]
    return {"values": values, "source": "profiled points (initial weights)"}


def stage_lr_multiplier(spec: JobSpec, epochs: EpochModel, global_batch: int, noise_scale: float | None) -> float:
    """The LR multiplier of a schedule's stage: the plan's rule at the run's mean noise scale (None), else the AdaScale
    gain at the stage's own (tula_service.plan.schedule); capped at training.max_lr / reference_lr, and at the measured
    stability headroom (EpochModel.lr_headroom)."""
    if noise_scale is None:
        multiplier = lr_rule(spec, global_batch, epochs)["multiplier"]["value"]
    else:
        gain = adascale_gain(global_batch / spec.training.reference_batch, noise_scale, spec.training.reference_batch)
        multiplier = lr_multiplier_of_gain(epochs.capped_gain(gain), spec.training.optimizer)
    training = spec.training
    if training.max_lr is not None and training.reference_lr:
        multiplier = min(multiplier, training.max_lr / training.reference_lr)
    return multiplier


def noise_profile_of(spec: JobSpec, pilot: PilotMeasurement | dict[str, Any] | None, efficiency: dict[str, Any]) -> NoiseProfile | None:
    """The noise scale's shape over the run (tula_service.plan.schedule.noise_profile) from the trajectory the
    efficiency model read (the reference run or the pilot, with the statistic it used); flat for other evidence;
    None without a noise scale."""
    noise = efficiency.get("noise_scale")
    if efficiency.get("source") != "fitted" or not noise:
        return None
    used = efficiency["evidence"]["used"]
    records = {"reference_run": list(spec.training.reference_run.gradient_stats) if spec.training.reference_run else [],
               "pilot": parse_measurement(pilot).trajectory if pilot is not None else []}.get(used)  # fmt: skip
    if not records:
        return flat_profile(noise["value"], f"{used} (no trajectory: one value for the whole run)")
    detail = next((c["detail"] for c in efficiency["evidence"]["candidates"] if c["source"] == used), {})
    return noise_profile(records, detail.get("statistic", "raw"), target_samples(spec), int(detail.get("batch") or spec.training.reference_batch),
                         noise["value"], f"{used.replace('_', ' ')} trajectory")  # fmt: skip


def _measured_limit(ok_batches: list[int], oom_batches: list[int]) -> dict[str, Any] | None:
    """The largest batch that ran and the smallest that did not, on the profiling device."""
    limits = bracket(ok_batches, oom_batches)
    if limits is None:
        return None
    return {"largest_ok_batch": limits[0], "smallest_oom_batch": limits[1], "source": "measured"}


def _point_summary(point: ComputeMeasurement) -> dict[str, Any]:
    iter_time, memory, gradient = point.iter_time, point.memory, point.gradient
    return {
        "batch_size": point.batch_size,
        "iter_time_median_s": iter_time.median_s,
        "iter_time_p10_s": iter_time.p10_s,
        "iter_time_p90_s": iter_time.p90_s,
        "iter_time_cv": iter_time.cv,
        "iter_time_robust_cv": iter_time.robust_cv,
        "samples": iter_time.count,
        "peak_bytes": memory.peak_bytes,
        "activation_bytes": memory.activation_bytes,
        "noise_scale": gradient.noise_scale if gradient else None,
        "variability_median": gradient.variability_median if gradient else None,
        "options": point.options,
        "host_contended": point.host_contended,
        "source": "measured",
    }


CAP_INTERVAL_WHY = (  # after "the LR is capped at <what caps it>" (EpochModel.lr_cap_why, else the measured headroom)
    " at this batch: the epochs lie between no cost from the cap "
    "and the quadratic model's cost of the capped step (which assumes the reference LR was the best step at the "
    "reference batch); the value is their geometric middle. Trained at the capped LR, three plain-SGD tasks landed "
    "inside at 12 of 14 capped batches, the quadratic model's end over-predicting them by 7-45%; on a GPT under SGD "
    "with momentum, whose cap (1.15x) was near the LR it advised anyway, the interval was a few percent wide and the "
    "epochs fell outside it at all 4 capped batches, by -7% to +13% (docs/validation.md)"
)


def _mark_epochs_intervals(rows: list[dict[str, Any]], epochs: Any, fixed_overhead_usd: float) -> None:
    """Each candidate whose LR the stability headroom caps gets its epochs' interval (EpochModel.cap_interval). With a
    calibrated noise-scale range (tula_service.fit.epochs_calibration), every candidate's epochs, total time and cost
    get `calibrated_interval`: the epochs between E(B) at the range's ends (EpochModel.interval), the time in
    proportion, the cost's time-billed part in proportion (the fixed overhead stays). Epochs fitted to measured runs
    with the statistics as a prior get the fit's own 80% interval the same way (its covariance, whose inputs, the
    prior's spread and a run's scatter, are measured across tasks)."""
    for row in rows:
        interval = epochs.cap_interval(row["global_batch"])
        if interval is not None:
            capped_at = epochs.lr_cap_why or "the measured stability headroom"
            row["epochs"].update(interval=list(interval), why=f"the LR is capped at {capped_at}{CAP_INTERVAL_WHY}")
        if not getattr(epochs, "banded", False):
            continue
        calibrated = epochs.interval(row["global_batch"])
        value = row["epochs"]["value"]
        if calibrated is None or not value > 0:
            continue
        row["epochs"]["calibrated_interval"] = list(calibrated)
        low, high = (end / value for end in calibrated)
        time, cost = row["total_time_s"]["value"], row["cost_usd"]["value"]
        row["total_time_s"]["calibrated_interval"] = [time * low, time * high]
        row["cost_usd"]["calibrated_interval"] = [fixed_overhead_usd + (cost - fixed_overhead_usd) * f for f in (low, high)]


GIVEN_EPOCHS_WHY = "the reference run's epochs (training.reference_epochs), which the model is anchored on: given, not predicted"


def _mark_given_epochs(rows: list[dict[str, Any]], epochs: Any) -> None:
    """At the reference batch an epochs model anchored on the reference run returns the spec's reference_epochs
    itself: those candidates' epochs are labelled `spec`, not `predicted`. A model fitted to other runs need not pass
    through it, and then the value stays a prediction."""
    batch, given = getattr(epochs, "reference_batch", None), getattr(epochs, "reference_epochs", None)
    if batch is None or given is None:
        return
    for row in rows:
        value = row["epochs"]["value"]
        if row["global_batch"] == batch and row["epochs"]["source"] == "predicted" and math.isclose(value, given, rel_tol=1e-9):
            row["epochs"].update(source="spec", why=GIVEN_EPOCHS_WHY)


EDGE_OBJECTIVES = {"min_time": "total_time_s", "min_cost": "cost_usd"}


def chosen_at_edge(rows: list[dict[str, Any]], chosen: int, objective: str, reference_batch: int) -> dict[str, Any] | None:
    """Whether the search's range, not the models, set the pick: the chosen per-device batch is the largest swept
    (batch_sizes.max, or what fits the memory) on its placement and accumulation, and the objective (time for
    min_time, cost for min_cost) still improves from the next smaller device batch to it. Then the optimum lies at
    or past the edge, and the pick's epochs are the efficiency model at its farthest extrapolation from the
    reference batch. Seen on an H200 (docs/validation.md, issue 17): step time flat in the batch, so min_time took
    the largest batch allowed, 32x the reference, where the ground truth's 42.5 epochs are 1.5x the model's at the
    reference run's noise scale and 5.6x at the pilot's the job had. None when the pick is
    inside the range, or for the other objectives (a deadline, a budget or the knee sets those picks)."""
    metric = EDGE_OBJECTIVES.get(objective)
    if metric is None:
        return None
    row = rows[chosen]
    same = [r for r in rows if r["placement"] == row["placement"] and r["accumulation"] == row["accumulation"]]
    smaller = [r for r in same if r["device_batch"] < row["device_batch"]]
    if row["device_batch"] != max(r["device_batch"] for r in same) or not smaller:
        return None
    neighbour = max(smaller, key=lambda r: r["device_batch"])
    improvement = 1.0 - row[metric]["value"] / neighbour[metric]["value"]
    if improvement <= 0:
        return None
    ratio = row["global_batch"] / reference_batch
    interval = row["epochs"].get("calibrated_interval")
    spread = f"; its calibrated interval is {interval[0]:.3g}-{interval[1]:.3g} epochs" if interval else ""
    return {
        "global_batch": row["global_batch"], "next_smaller_global_batch": neighbour["global_batch"], "improvement": improvement,
        "batch_over_reference": ratio,
        "why": (f"device batch {row['device_batch']} is the largest the search allowed (batch_sizes.max or the memory), and "
                f"{objective} still improves {improvement:.1%} from global batch {neighbour['global_batch']} to "
                f"{row['global_batch']}: the range set this pick, not the models, and its epochs ({row['epochs']['value']:.3g}) "
                f"are the efficiency model {ratio:.3g}x past the reference batch, its farthest extrapolation{spread}. Past "
                "the batches its evidence measured, epochs can grow faster than E(B) = E_min (1 + B / B_noise) allows; a "
                "run at the next smaller batch, or a reference run nearer this one, checks it"),
    }  # fmt: skip


def _candidate_row(
    candidates: dict[str, np.ndarray], i: int, front: np.ndarray, measured: dict[int, ComputeMeasurement], report: dict,
    step_err: float | None = None, measured_steps: dict[tuple[tuple[int, ...], int], float] | None = None,
) -> dict[str, Any]:
    """One candidate as the recommendation gives it. step_err: the held-out error of the step-time model fitted
    to measured multi-device steps (the multi-device rows' error; the compute model's where None);
    measured_steps: step seconds measured at (placement, device batch)."""
    b, n, a = (int(candidates[key][i]) for key in ("device_batch", "devices", "accumulation"))
    kind = int(candidates["placement_kind"][i])
    placement = gpus_on_nodes(n, int(candidates["nodes"][i]), int(candidates["per_node"][i]), kind)
    point = measured.get(b)
    time_err = report["compute"]["leave_one_out"]["median_rel_err"]
    if n > 1 and step_err is not None:
        time_err = step_err
    mem_err = report["memory"]["leave_one_out"]["median_rel_err"]

    def predicted(key: str, rel_err: float | None = time_err) -> dict[str, Any]:
        return {"value": float(candidates[key][i]), "source": "predicted", "rel_err": rel_err}

    if point:
        memory = {"value": float(point.memory.peak_bytes), "source": "measured"}
    elif report["memory"]["source"] == "assumed":
        memory = {"value": None, "source": "assumed"}  # not measured (steps only): the batches that ran are taken to fit
    else:
        memory = predicted("memory_bytes", mem_err)
    iter_time = (
        {"value": float(point.iter_time.median_s), "source": "measured"}
        if point and n == 1 and a == 1
        else predicted("iter_time_s")
    )
    step_measured = (measured_steps or {}).get((tuple(placement), b)) if a == 1 and n > 1 else None
    return {
        "device_batch": b,
        "devices": n,
        "placement": placement,
        "placement_kind": PLACEMENT_KINDS[kind],
        "accumulation": a,
        "global_batch": int(candidates["global_batch"][i]),
        "memory_bytes": memory,
        "iter_time_s": iter_time,
        "step_time_s": {"value": step_measured, "source": "measured"} if step_measured else predicted("step_time_s"),
        "epochs": {
            "value": float(candidates["epochs"][i]),
            "source": "assumed" if report["efficiency"]["source"] == "assumed" else "predicted",
        },
        "epoch_time_s": predicted("epoch_time_s"),
        "total_time_s": predicted("total_time_s"),
        "cost_usd": predicted("cost_usd"),
        "pareto": bool(front[i]),
    }
