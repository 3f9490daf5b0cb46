"""Adaptive gradient scaling (AGS), the training-loop side of Tula's advice.

Per optimizer step t, on the gradient g_t the optimizer is about to apply (after DDP's all-reduce,
after the last micro-batch of gradient accumulation, after an AMP grad scaler's unscaling):

    n_t    = ||g_t||_2                                   global L2 norm over all parameters
    v_t    = | n_t - n_{t-1} | / max(n_{t-1}, eps)       gradient variability
    vbar_t = v_t                                         smoothing = 0 (the default)
           = beta vbar_{t-1} + (1 - beta) v_t            EMA with beta = smoothing, vbar_2 = v_2
    g_t   <- s g_t   if vbar_t < delta, else unchanged   the AGS rule

The first step has no previous norm, hence no variability: it is never scaled. Steps whose norm is
inf/nan (an fp16 overflow) get no decision and leave the state as it was.

Source: the Tula seed paper ("Tula", the AGS part; `../shared/seeds/000_*.txt`). The seed text we hold
has the abstract, the figure captions and Table I, not the equations: Fig. 5a tracks the gradient
l2-norm over iterations, Fig. 6 calls the variability "the rate of gradient change" and shows it
mirrors convergence, Fig. 7 scales the update by s at delta = 0.5 ("excessive scaling degrades
convergence quality"), Fig. 8 says "larger delta biases training toward scaled updates, while a
smaller delta favors unscaled (sensitive) updates" -- so an update is scaled when its variability is
*below* delta. The variability above is the relative change of the gradient l2-norm between
consecutive iterations, the quantity `profiler.gradstats` measures and whose median the service
recommends as delta (`tula_service.plan.advice.ags_config`).

Use, in any loop (two lines):

    ags = AdaptiveGradientScaler.from_config(recommendation)     # the service's JSON as is
    ...; loss.backward(); ags.step_scale(optimizer); optimizer.step()

or wrap the optimizer once: `optimizer = AdaptiveGradientScaler.wrap(optimizer, delta=0.1, s=2.0)`,
after which `optimizer.step()` (or `grad_scaler.step(optimizer)` under AMP) decides first.

Distributed: under DistributedDataParallel the gradients are already averaged when `backward()`
returns (on the last micro-batch when accumulating under `no_sync()`), so every rank computes the
same norm; with a `process_group` the norm is also averaged over the group (one scalar all-reduce) so
the decision is identical on every rank to the last bit. Without DDP (each rank holding its local
gradient), `all_reduce_gradients=True` averages the gradients over the group first.

The decision reads the norm on the host (`.item()`): one device synchronization per optimizer step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

STATE_VERSION = 1


@dataclass(frozen=True)
class Decision:
    """What step_scale did on one optimizer step."""

    step: int  # 1-based count of decided steps (skipped steps not counted)
    grad_norm: float  # n_t, before scaling
    variability: float | None  # v_t; None on the first step
    smoothed_variability: float | None  # vbar_t, what was compared with delta
    scaled: bool
    factor: float  # s when scaled, else 1.0
    skipped: bool = False  # non-finite gradients: no decision, state unchanged


def _number(section: Any, key: str) -> float:
    value = section.get(key) if isinstance(section, dict) else None
    if isinstance(value, dict):
        value = value.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"AGS config has no number for '{key}' (got {value!r}); expected the service's "
            f"training_advice.ags object ({{'{key}': {{'value': ...}}}}) or a plain number"
        )
    return float(value)


def config_values(config: Any) -> tuple[float, float]:
    """(delta, s) from the service's AGS JSON as is: a whole recommendation (also the API's
    `/recommendation` body), its `training_advice`, the `ags` object with `{value, source, why}`
    entries, plain numbers (`{"delta": 0.1, "s": 2}`), or any of these as JSON text or a file path."""
    if isinstance(config, (str, bytes, os.PathLike)):
        text = config.decode() if isinstance(config, bytes) else str(config)
        config = json.loads(text) if text.lstrip().startswith("{") else json.loads(open(text).read())
    if not isinstance(config, dict):
        raise ValueError(f"AGS config must be a JSON object, got {type(config).__name__}")
    if "training_advice" in config:
        config = config["training_advice"]
    if "ags" in config:
        config = config["ags"]
    return _number(config, "delta"), _number(config, "s")


def _gradients(parameters_or_optimizer: Any) -> list[torch.Tensor]:
    if hasattr(parameters_or_optimizer, "param_groups"):  # an optimizer, or an AGSOptimizer
        params: Iterable = (p for group in parameters_or_optimizer.param_groups for p in group["params"])
    elif isinstance(parameters_or_optimizer, torch.Tensor):
        params = [parameters_or_optimizer]
    else:
        params = parameters_or_optimizer
    return [p.grad for p in params if p.grad is not None]


class AdaptiveGradientScaler:
    """Scale the gradients by s on steps whose gradient variability is below delta (module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        delta: float,
        s: float,
        smoothing: float = 0.0,
        eps: float = 1e-12,
        process_group: Any = None,
        all_reduce_gradients: bool = False,
    ):
        if not delta >= 0:  # inf is allowed: scale every step after the first (static scaling)
            raise ValueError(f"delta must be a number >= 0 (got {delta})")
        if not (s > 0 and math.isfinite(s)):
            raise ValueError(f"s must be a finite number > 0 (got {s})")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing is the EMA's beta and must be in [0, 1) (got {smoothing})")
        if all_reduce_gradients and process_group is None:
            raise ValueError("all_reduce_gradients needs a process_group (e.g. torch.distributed.group.WORLD)")
        self.optimizer = optimizer
        self.delta, self.s, self.smoothing, self.eps = float(delta), float(s), float(smoothing), float(eps)
        self.process_group = process_group
        self.all_reduce_gradients = all_reduce_gradients
        self.steps = 0
        self.scaled_steps = 0
        self.skipped_steps = 0
        self.prev_norm: float | None = None
        self.ema: float | None = None
        self.last_norm: float | None = None
        self.last_variability: float | None = None

    @classmethod
    def from_config(cls, config: Any, optimizer: torch.optim.Optimizer | None = None, **options: Any) -> AdaptiveGradientScaler:
        """From the service's AGS JSON as is (see `config_values`); `options` as in the constructor."""
        delta, s = config_values(config)
        return cls(optimizer, delta=delta, s=s, **options)

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, config: Any = None, **options: Any) -> AGSOptimizer:
        """`optimizer` whose `step()` first calls `step_scale`; `config` as in `from_config`, or
        `delta=`, `s=` and the other constructor options as keywords."""
        scaler = cls.from_config(config, optimizer, **options) if config is not None else cls(optimizer, **options)
        return AGSOptimizer(optimizer, scaler)

    # -- the decision ------------------------------------------------------------------------------

    def step_scale(self, parameters_or_optimizer: Any = None, grad_scaler: Any = None) -> Decision:
        """Between `backward()` (the last micro-batch's) and `optimizer.step()`: measure, decide, scale.

        `grad_scaler` (torch.amp.GradScaler): its `unscale_(optimizer)` runs first (unless already
        called this iteration), so the norm is the true one; the scaler's `step()` then does not
        unscale again and skips the update itself when the gradients are inf/nan.
        """
        target = self.optimizer if parameters_or_optimizer is None else parameters_or_optimizer
        if target is None:
            raise ValueError("step_scale needs parameters or an optimizer (none given here or to the constructor)")
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._unscale(grad_scaler, target)
        grads = _gradients(target)
        if not grads:
            raise ValueError("no parameter has a gradient: call step_scale after backward() and before step()")
        if self.all_reduce_gradients:
            self._average_over_group(grads)
        norm = self._global_norm(grads)
        if not math.isfinite(norm):
            self.skipped_steps += 1
            return Decision(self.steps, norm, None, None, scaled=False, factor=1.0, skipped=True)
        variability = None if self.prev_norm is None else abs(norm - self.prev_norm) / max(self.prev_norm, self.eps)
        if variability is not None:
            first = self.ema is None
            self.ema = variability if first or self.smoothing == 0 else self.smoothing * self.ema + (1 - self.smoothing) * variability
        scaled = variability is not None and self.ema < self.delta
        if scaled and self.s != 1.0:
            for g in grads:
                g.mul_(self.s)
        self.steps += 1
        self.scaled_steps += int(scaled)
        self.prev_norm = self.last_norm = norm
        self.last_variability = variability
        return Decision(self.steps, norm, variability, self.ema if variability is not None else None, scaled, self.s if scaled else 1.0)

    def _unscale(self, grad_scaler: Any, target: Any) -> None:
        if not hasattr(target, "param_groups"):
            raise ValueError("with a grad_scaler, pass the optimizer (GradScaler unscales per optimizer)")
        try:
            grad_scaler.unscale_(target)
        except RuntimeError as error:  # the loop unscaled already (e.g. to clip): the gradients are true ones
            if "already been called" not in str(error):
                raise

    def _average_over_group(self, grads: list[torch.Tensor]) -> None:
        world = dist.get_world_size(self.process_group)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        norm = torch.nn.utils.get_total_norm([g.detach() for g in grads], 2.0).float()
        if self.process_group is not None:
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=self.process_group)
            norm /= dist.get_world_size(self.process_group)
        return float(norm)

    # -- logging and checkpoints -------------------------------------------------------------------

    @property
    def scaled_fraction(self) -> float:
        return self.scaled_steps / self.steps if self.steps else 0.0

    def metrics(self) -> dict[str, float | int | None]:
        """Counters for a logger: steps, scaled_steps, scaled_fraction, skipped_steps, last_norm,
        last_variability (raw v_t) and smoothed_variability (vbar_t, what is compared with delta)."""
        return {
            "steps": self.steps,
            "scaled_steps": self.scaled_steps,
            "scaled_fraction": self.scaled_fraction,
            "skipped_steps": self.skipped_steps,
            "last_norm": self.last_norm,
            "last_variability": self.last_variability,
            "smoothed_variability": self.ema,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "delta": self.delta,
            "s": self.s,
            "smoothing": self.smoothing,
            "eps": self.eps,
            "steps": self.steps,
            "scaled_steps": self.scaled_steps,
            "skipped_steps": self.skipped_steps,
            "prev_norm": self.prev_norm,
            "ema": self.ema,
            "last_norm": self.last_norm,
            "last_variability": self.last_variability,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"AGS state version {state.get('version')!r} is not {STATE_VERSION}")
        for key in ("delta", "s", "smoothing", "eps", "steps", "scaled_steps", "skipped_steps",
                    "prev_norm", "ema", "last_norm", "last_variability"):  # fmt: skip
            setattr(self, key, state[key])


class AGSOptimizer:
    """An optimizer whose `step()` runs `AdaptiveGradientScaler.step_scale` first.

    It forwards `param_groups`, `state`, `zero_grad` and every other attribute to the wrapped
    optimizer, so `torch.amp.GradScaler.step(ags_optimizer)` works: the grad scaler unscales, skips
    the step on inf/nan, and otherwise calls this `step()`, which then sees the true gradients.
    LR schedulers take the wrapped optimizer: `LRScheduler(ags_optimizer.optimizer, ...)`.
    `state_dict()` holds both: `{"optimizer": ..., "ags": ...}`.
    """

    _step_supports_amp_scaling = False  # GradScaler must unscale before calling step()

    def __init__(self, optimizer: torch.optim.Optimizer, ags: AdaptiveGradientScaler):
        self.optimizer = optimizer
        self.ags = ags
        self.last_decision: Decision | None = None

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "ags"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_decision = self.ags.step_scale(self.optimizer)
        self.optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "ags": self.ags.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.ags.load_state_dict(state["ags"])
