"""How to train at the chosen configuration: learning rate, warm-up, AGS, runner-ups.

- LR rule for a batch k = B / B_ref times the reference, never above the spec's max_lr: linear scaling
  for SGD (Goyal et al. 2017), square root for Adam/AdamW, and the efficiency model's LR multiplier when it
  has a noise scale: the AdaScale gain (Johnson et al. 2020)
      r(k) = (sigma^2 + |G|^2) / (sigma^2 / k + |G|^2) = (1 + B_noise / B_ref) / (1 + B_noise / (k B_ref)),
  in [1, k], as is for SGD and its square root for Adam (Pollux/AdaptDL); the formula lives with the epochs
  model (tula_service.fit.perfmodel.efficiency: EfficiencyModel.step_gain, lr_multiplier).
  Above the reference LR, stability is the user's evidence (training.max_lr caps the LR), the stability
  headroom measured along the run (profiler.sharpness; the efficiency model caps its multiplier there) or an
  assumption, and the rule says which ("stability"): where the noise scale read is too high, the rule raises the LR
  too far (benchmarks/advised_lr.py, docs/validation.md).
- Warm-up: gradual (linear) warm-up to the scaled LR over min(5 epochs, 10% of training) when the
  batch grows (Goyal et al. 2017 use 5 epochs at k = 32).
- The batch schedule over the run (tula_service.plan.schedule) is chosen by predicted time to the target.
- AGS (Tula): scale the update by s on iterations whose gradient variability is below delta. delta is
  the median of the variability predicted at the chosen batch B (about half the updates scaled, the
  study's balanced setting; 0.5 when nothing was measured), from values measured at batch b along the
  reference run or pilot (else at the profiled points): the step-to-step change of the gradient norm is
  taken to be sampling noise, whose size relative to |g_B| is sqrt(tr(Sigma)/B / (|G|^2 + tr(Sigma)/B)), so
      v(B) = v(b) sqrt((b + B_noise) / (B + B_noise)).
  s is the AdaScale gain at the chosen batch, capped at AGS_MAX_SCALE because too large an s hurts
  convergence (Tula seed paper, Fig. 7).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tula_service.fit.perfmodel.efficiency import EfficiencyModel
from tula_service.spec.job_spec import OPTIMIZER_NAMES

LR_STABILITY_ASSUMED = (
    "assumed: the reference run shows the optimizer stable at the reference LR only, and this rule raises it. Measured "
    "(benchmarks/advised_lr.py): plain SGD read a noise scale 2.5x its critical batch, and the rule's 2.1x LR at 4x the "
    "reference batch took 2.8x the epochs of the best LR there; at 8x and 16x 1 seed in 8 reached the target (on the "
    "digits CNN without momentum, none at 8x and 16x). Give "
    "training.max_lr, the largest LR that trained, or measure the stability headroom along the reference run "
    "(GradientStatsLogger.measure_stability), to cap it"
)
AGS_DEFAULT_DELTA = 0.5
AGS_MAX_SCALE = 2.0
WARMUP_MAX_EPOCHS = 5.0
WARMUP_MAX_FRACTION = 0.10


def lr_rule(spec, global_batch: int, efficiency: EfficiencyModel) -> dict[str, Any]:
    k = global_batch / spec.training.reference_batch
    rules = {"linear": k, "sqrt": math.sqrt(k)}
    noise_scale = efficiency.noise_scale
    capped = bool(noise_scale) and efficiency.lr_capped(global_batch)
    if noise_scale:
        rules["adascale"] = efficiency.lr_multiplier(global_batch)
    recommended = "adascale" if noise_scale else ("linear" if spec.training.optimizer == "sgd" else "sqrt")
    factor = rules[recommended]
    result = {
        "batch_ratio_k": k,
        "optimizer": spec.training.optimizer,
        "multipliers": rules,
        "recommended": recommended,
        "multiplier": {"value": factor, "source": "fitted" if noise_scale else "assumed"},
        "why": (
            f"AdaScale gain from the efficiency model's B_noise ({noise_scale:.3g})"
            + (f" (square root for {OPTIMIZER_NAMES[spec.training.optimizer]})" if spec.training.optimizer != "sgd" else "")
            + (f", capped at {efficiency.cap_description()}" if capped else "")
            if noise_scale
            else ("linear scaling (Goyal et al. 2017) for SGD" if spec.training.optimizer == "sgd" else f"square-root scaling for {OPTIMIZER_NAMES[spec.training.optimizer]}")
            + "; no noise measurement for AdaScale"
        ),
    }
    if spec.training.optimizer == "sgd":
        result["momentum"] = spec.training.sgd_momentum()  # the LR is advised for SGD with this momentum
    result["optimizer_settings"] = spec.training.optimizer_settings()
    if spec.training.reference_lr:
        lr = spec.training.reference_lr * factor
        result["lr"] = {"value": lr, "reference_lr": spec.training.reference_lr, "source": "predicted"}
        max_lr = spec.training.max_lr
        if max_lr is not None and lr > max_lr:
            result["lr"].update(value=max_lr, capped_from=lr, why=f"the rule's {lr:.4g} is above training.max_lr: capped (spec)")
    if factor > 1.0:
        result["stability"] = _stability(spec.training, efficiency.lr_headroom if noise_scale else None)
    return result


def _stability(training, lr_headroom: float | None) -> dict[str, str]:
    """Whether the LR the rule raises is known to train (module docstring, LR rule): the lower cap says."""
    max_lr = training.max_lr
    if max_lr is not None and (lr_headroom is None or max_lr <= lr_headroom * training.reference_lr):
        return {"source": "spec", "why": "never above training.max_lr, the largest LR the user's runs trained with"}
    if lr_headroom is not None:
        return {"source": "measured", "why": f"measured: never above {lr_headroom:.3g}x the reference LR, the stability headroom measured along the "
                "run (profiler.sharpness: (2 + 2 beta) / (eta lambda_max)); a lower bound on what trains, so the cap is safe, not fast"}  # fmt: skip
    return {"source": "assumed", "why": LR_STABILITY_ASSUMED}


def warmup(spec, chosen: dict[str, Any]) -> dict[str, Any]:
    epochs = chosen["epochs"]["value"]
    if chosen["global_batch"] <= spec.training.reference_batch:
        return {"epochs": 0.0, "steps": 0, "why": "batch not larger than the reference: no warm-up needed"}
    warmup_epochs = min(WARMUP_MAX_EPOCHS, WARMUP_MAX_FRACTION * epochs)
    steps = int(math.ceil(warmup_epochs * spec.dataset.num_samples / chosen["global_batch"]))
    return {
        "epochs": warmup_epochs,
        "steps": steps,
        "schedule": "linear from the reference LR to the scaled LR",
        "why": f"min({WARMUP_MAX_EPOCHS:g} epochs, {WARMUP_MAX_FRACTION:.0%} of training), after Goyal et al. 2017",
    }


def variability_at_batch(measured: list[tuple[float, int]], global_batch: int, noise_scale: float | None) -> list[float]:
    """v(B) = v(b) sqrt((b + B_noise) / (B + B_noise)) for each (v, b) measured (module docstring); as
    measured when there is no noise scale."""
    if not noise_scale:
        return [value for value, _ in measured]
    return [value * math.sqrt((batch + noise_scale) / (global_batch + noise_scale)) for value, batch in measured]


def ags_config(global_batch: int, spec, efficiency: EfficiencyModel, variability: dict[str, Any]) -> dict[str, Any]:
    """variability: {"values": [(v, batch it was measured at), ...], "source": where they come from}."""
    noise_scale = efficiency.noise_scale
    measured = variability.get("values") or []
    if measured:
        predicted = variability_at_batch(measured, global_batch, noise_scale)
        batches = sorted({batch for _, batch in measured})
        delta = {"value": float(np.median(predicted)), "source": "predicted" if noise_scale else "measured",
                 "evidence": variability.get("source"),
                 "why": f"median of {len(measured)} gradient-variability values measured along the {variability.get('source')} "
                 f"at batch {'/'.join(map(str, batches))}"
                 + (f", scaled to batch {global_batch} by sqrt((b + B_noise) / (B + B_noise))" if noise_scale else "")
                 + ": about half the updates are scaled"}  # fmt: skip
    else:
        delta = {"value": AGS_DEFAULT_DELTA, "source": "assumed", "why": "no variability measured: the Tula study's 0.5"}
    k = global_batch / spec.training.reference_batch
    if noise_scale and k > 1:
        gain = efficiency.step_gain(global_batch)
        scale = {"value": min(gain, AGS_MAX_SCALE), "source": "fitted",
                 "why": f"AdaScale gain {gain:.2f} at k={k:g}, capped at {AGS_MAX_SCALE:g} (too large an s hurts, Tula Fig. 7)"}  # fmt: skip
    elif k > 1:
        scale = {"value": min(math.sqrt(k), AGS_MAX_SCALE), "source": "assumed",
                 "why": f"no noise measurement: sqrt(k) = {math.sqrt(k):.2f}, capped at {AGS_MAX_SCALE:g}"}  # fmt: skip
    else:
        scale = {"value": 1.0, "source": "assumed", "why": "batch not larger than the reference: nothing to compensate"}
    return {"delta": delta, "s": scale, "rule": "scale the update by s when gradient variability < delta"}


def _delta_pct(value: float, chosen: float) -> float | None:
    """100 (value / chosen - 1); None where the chosen's is 0 (a price so small that the cost underflows)."""
    return 100.0 * (value / chosen - 1.0) if chosen else None


def runner_ups(rows: list[dict[str, Any]], chosen_index: int, order: np.ndarray, count: int = 3) -> list[dict[str, Any]]:
    """The next candidates in the objective's order, with time and cost relative to the chosen."""
    chosen = rows[chosen_index]
    result = []
    for index in order:
        if index == chosen_index:
            continue
        row = rows[int(index)]
        result.append({
            "device_batch": row["device_batch"], "devices": row["devices"], "placement": row["placement"], "accumulation": row["accumulation"],
            "global_batch": row["global_batch"], "total_time_s": row["total_time_s"]["value"], "cost_usd": row["cost_usd"]["value"],
            "time_delta_pct": _delta_pct(row["total_time_s"]["value"], chosen["total_time_s"]["value"]),
            "cost_delta_pct": _delta_pct(row["cost_usd"]["value"], chosen["cost_usd"]["value"]),
            "source": row["total_time_s"]["source"], "rel_err": row["total_time_s"].get("rel_err"),
        })  # fmt: skip
        if len(result) == count:
            break
    return result
