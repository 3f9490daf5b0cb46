"""The preconditioner of an adaptive optimizer, read from its state: the P in its update -eta P g.

An adaptive optimizer divides each coordinate of the gradient by a running root mean square of its past
gradients (Adamax: by a decaying maximum of their sizes), so its noise-to-signal ratio (the noise scale the critical
batch follows) is that of P g, not of g (tula_service.fit.efficiency_evidence; measured in docs/validation.md), and its
stable range is set by the preconditioned Hessian P^(1/2) H P^(1/2) (profiler.sharpness). P = diag(1 / (sqrt(v) +
eps)), with v:

- Adam and AdamW (Kingma & Ba 2015, alg. 1): v = exp_avg_sq / (1 - beta2^t), the bias-corrected EMA of g^2
  (max_exp_avg_sq in place of exp_avg_sq with amsgrad);
- NAdam (Dozat 2016; torch.optim.NAdam): v = exp_avg_sq / (1 - beta2^t), as Adam's (it has no amsgrad): its step
  divides both of its terms, g and the EMA of g, by sqrt(v) + eps;
- RMSprop (Tieleman & Hinton 2012, lecture 6.5; PyTorch's torch.optim.RMSprop): v = square_avg, the EMA of g^2 with
  weight alpha, no bias correction; centered (Graves 2013, eq. 38-40): v = square_avg - grad_avg^2.

RAdam (Liu et al. 2020, alg. 2; torch.optim.RAdam) puts eps outside the bias correction: its rectified step is
eta rect_t m_hat sqrt(1 - beta2^t) / (sqrt(exp_avg_sq) + eps), m_hat = exp_avg / (1 - beta1^t), so its P is
sqrt(1 - beta2^t) / (sqrt(exp_avg_sq) + eps), the denominator (sqrt(exp_avg_sq) + eps) / sqrt(1 - beta2^t). In its
first steps (rho_t <= 5: t <= 5 at beta2 0.999) RAdam takes the un-preconditioned step eta m_hat, which does not
divide by P; P is still read there, by the same formula from the same state, so that P g means the same thing at
every step (profiler.sharpness gives no threshold for such a step).

Adamax (Kingma & Ba 2015, sec. 7.1, alg. 2; torch.optim.Adamax) divides by an infinity norm in place of sqrt(v):
u = max(beta2 u, |g| + eps) (exp_inf; the paper has no eps, torch adds it to |g| inside the max), and steps by
-eta / (1 - beta1^t) m / u, m the EMA of g as Adam's, so P = 1 / u, the denominator u itself (no bias correction, no
square root, and no eps added: it is in u already); its 1 / (1 - beta1^t) is a factor of the LR (profiler.sharpness).

Adagrad (Duchi et al. 2011; torch.optim.Adagrad) divides by the root of the sum of every past g^2, not of a moving
average: sum = initial_accumulator_value + sum_t g_t^2 ("sum"), the step -eta / (1 + (t - 1) lr_decay) g / (sqrt(sum) +
eps), so P = 1 / (sqrt(sum) + eps); no momentum, no bias correction. Its state exists before the first step (step 0,
sum = initial_accumulator_value): it holds no gradient yet, so P is read only from t >= 1, as the others' are, and the
coming step's only from the second step on (the first would divide each coordinate by its own |g|, a noise scale of
the micro-batches' spread over it, with no history: a pilot's first record read -2e7 on an MLP).

Adafactor (Shazeer & Stern 2018; torch.optim.Adafactor) keeps, for a weight of two or more dimensions, only the row and
column means of g^2 over its last two (row_var R, col_var C: EMAs with 1 - beta2_t = t^beta2_decay, -0.8 by default,
so its first step takes g^2 whole) and divides by the rank-one V_hat = R C / max(mean(R), eps1); a vector keeps its
own EMA of g^2 (variance). Its step is -alpha_t U / max(1, RMS(U) / d), U = g / max(sqrt(V_hat), eps1), with the
relative step alpha_t = max(eps2, RMS(theta)) min(lr, 1 / sqrt(t)) per tensor (eps1 None: the dtype's machine
epsilon). Written as the others' -eta P g with eta = lr:
    P = max(eps2, RMS(theta)) min(1, 1 / (lr sqrt(t))) / max(sqrt(V_hat), eps1)
the parameter's size a factor of P, so tensors of different scales weigh in P g as the step weighs them (RMS(theta)
of the parameter as it is now: the coming step's alpha). Left out: the update clipping 1 / max(1, RMS(U) / d), which
depends on the sampled gradient itself, not on the state, and can only shrink a step (d = 1 by default: a tensor's
step is cut wherever its U's RMS passes 1).

preconditioner() and preconditioner_squares() read P from the state as it is: right after a step, the P that step
divided by (as benchmarks/efficiency_tasks.py reads it); an optimizer that has taken no step has none. Before a step
the state lacks that step's own gradient, so the user's logger, the pilot and profiler.sharpness, which run before
it, take the coming step's P instead (below).

The coming step's P (coming_step_preconditioner), for profiler.sharpness: the step folds its own gradient g into
the state before it divides, v' = beta2 v + (1 - beta2) g^2 at t + 1 (Adam, AdamW, NAdam, RAdam; amsgrad's max of
it), RMSprop's square_avg' = alpha square_avg + (1 - alpha) g^2 (and grad_avg' = alpha grad_avg + (1 - alpha) g,
centered), Adamax's u' = max(beta2 u, |g| + eps), Adagrad's sum' = sum + g^2, Adafactor's R, C (or v) moved towards
g^2's row and column means by (t + 1)^beta2_decay. With g the gradient at the point (the mean over the loss's samples,
its noise left out: E[g^2] >= G^2, so this is the smallest v' the step can have, the largest P). Where a coordinate's
state is stale, v far below the gradient now there (a ReLU unit that has just come back, so its weights had no
gradient for many steps), P read from the state is up to 1 / eps, while the step would divide by at least
sqrt(1 - beta2) |g|: 10^5 to 10^6 times the median P on the digits MLP under Adamax, which made one read of the
preconditioned sharpness 50x its neighbours (docs/validation.md, "The coming step's preconditioner").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                       torch.optim.Adagrad, torch.optim.Adafactor)


def is_adaptive(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer's update is a preconditioned gradient this module can read (Adam, AdamW, RMSprop, NAdam,
    RAdam, Adamax, Adagrad, Adafactor)."""
    return isinstance(optimizer, ADAPTIVE_OPTIMIZERS)


def denominator(optimizer: torch.optim.Optimizer, group: dict, state: dict | None, param: torch.Tensor | None = None) -> torch.Tensor | None:
    """1 / P for one parameter (module docstring): sqrt(v) + eps, RAdam's (sqrt(exp_avg_sq) + eps) / sqrt(1 - beta2^t),
    Adamax's u (exp_inf), Adagrad's sqrt(sum) + eps, or Adafactor's max(sqrt(V_hat), eps1) over its relative step (which
    needs `param`); a new tensor; None while its state holds no second moment (no step taken with a gradient for it)."""
    if not state:
        return None
    if isinstance(optimizer, torch.optim.Adafactor):
        return _adafactor_denominator(group, state, param) if "step" in state and float(state["step"]) > 0 else None
    if isinstance(optimizer, torch.optim.Adagrad):
        return state["sum"].sqrt().add_(group["eps"]) if "sum" in state and float(state["step"]) > 0 else None
    if isinstance(optimizer, torch.optim.Adamax):
        return state["exp_inf"].clone() if "exp_inf" in state else None
    if isinstance(optimizer, torch.optim.RMSprop):
        if "square_avg" not in state:
            return None
        second_moment = state["square_avg"]
        if group.get("centered"):
            second_moment = second_moment.addcmul(state["grad_avg"], state["grad_avg"], value=-1)
        return second_moment.sqrt().add_(group["eps"])
    if "exp_avg_sq" not in state:
        return None
    bias_correction = 1 - group["betas"][1] ** _step_count(state)
    if isinstance(optimizer, torch.optim.RAdam):
        return state["exp_avg_sq"].sqrt().add_(group["eps"]).div_(bias_correction**0.5)
    second_moment = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
    return (second_moment / bias_correction).sqrt_().add_(group["eps"])


def _adafactor_variance(group: dict, state: dict, dtype: torch.dtype) -> torch.Tensor:
    """Adafactor's V_hat from its state: R C / max(mean(R), eps1) over a weight's last two dimensions (row_var, col_var),
    a vector's own EMA of g^2 (variance); a new tensor."""
    eps1 = _adafactor_eps1(group, dtype)
    if "row_var" not in state:
        return state["variance"].clone()
    row_var, col_var = state["row_var"], state["col_var"]
    return (row_var @ col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))


def _adafactor_eps1(group: dict, dtype: torch.dtype) -> float:
    """Adafactor's eps1, the dtype's machine epsilon where it is None (torch.optim.Adafactor's default)."""
    eps1 = group["eps"][0]
    return torch.finfo(dtype).eps if eps1 is None else float(eps1)


def _adafactor_denominator(group: dict, state: dict, param: torch.Tensor | None) -> torch.Tensor:
    """Adafactor's 1 / P = max(sqrt(V_hat), eps1) / (max(eps2, RMS(theta)) min(1, 1 / (lr sqrt(t)))) (module
    docstring), t the state's step, theta `param` as it is now."""
    if param is None:
        raise ValueError("Adafactor's preconditioner scales with its parameter's RMS: pass the parameter")
    variance = _adafactor_variance(group, state, param.dtype)
    eps1, eps2 = _adafactor_eps1(group, param.dtype), float(group["eps"][1])
    lr, step = float(group["lr"]), float(state["step"])
    relative_step = 1.0 if lr * math.sqrt(step) <= 1.0 else 1.0 / (lr * math.sqrt(step))  # min(lr, 1 / sqrt(t)) / lr
    # RMS(theta) stays a tensor on theta's device: no host sync per parameter where the logger reads P each sampled step
    size = param.detach().norm().div(math.sqrt(param.numel())).clamp_(min=eps2)
    return variance.clamp_(min=eps1 * eps1).sqrt_().div_(size * relative_step)


def _step_count(state: dict) -> float | torch.Tensor:
    """The steps taken, t, as the optimizer reads it: a Python float where the state keeps it on the CPU (as Adam, NAdam
    and RAdam do: 1 - beta2^t in float32 loses digits at small t), the tensor where it is on the device (capturable)."""
    step = state["step"]
    return float(step) if isinstance(step, torch.Tensor) and step.device.type == "cpu" else step


def preconditioner_squares(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor] | None:
    """P^2 per parameter from the state as it is now (before this step); None before the optimizer's first step. A
    parameter with no state yet (no gradient so far) gets P = 0, which leaves it out of the preconditioned norms."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    squares, any_state = [], False
    for param in params:
        denominator_ = denominator(optimizer, group_of[id(param)], optimizer.state.get(param), param)
        if denominator_ is None:
            squares.append(torch.zeros_like(param))
            continue
        any_state = True
        squares.append(denominator_.reciprocal_().square_())
    return squares if any_state else None


def preconditioner(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> torch.Tensor | None:
    """P, flat in the order of the params that require a gradient; None before the optimizer's first step."""
    squares = preconditioner_squares(optimizer, [p for p in params if p.requires_grad])
    return None if squares is None else torch.cat([square.sqrt().reshape(-1) for square in squares])


def _state_after(optimizer: torch.optim.Optimizer, group: dict, state: dict, gradient: torch.Tensor) -> dict:
    """A copy of the parameter's state as the optimizer's step would leave its second moment (Adamax: its infinity
    norm) and step count with `gradient` as the step's gradient (module docstring); the state itself is not changed."""
    after = dict(state)
    if isinstance(optimizer, torch.optim.Adafactor):
        return _adafactor_state_after(group, state, gradient) if "step" in state and float(state["step"]) > 0 else after
    if isinstance(optimizer, torch.optim.Adagrad):  # its state is there before any step, but holds no gradient until one
        if float(state["step"]) > 0:
            after["sum"], after["step"] = state["sum"] + gradient.square(), float(state["step"]) + 1
        return after
    if not {"exp_inf", "square_avg", "exp_avg_sq"} & set(state):
        return after  # no second moment yet: denominator() says so
    if isinstance(optimizer, torch.optim.Adamax):
        after["exp_inf"] = torch.maximum(state["exp_inf"] * group["betas"][1], gradient.abs() + group["eps"])
    elif isinstance(optimizer, torch.optim.RMSprop):
        alpha = group["alpha"]
        after["square_avg"] = state["square_avg"] * alpha + (1 - alpha) * gradient.square()
        if group.get("centered"):
            after["grad_avg"] = state["grad_avg"] * alpha + (1 - alpha) * gradient
    elif "exp_avg_sq" in state:
        beta2 = group["betas"][1]
        after["exp_avg_sq"] = state["exp_avg_sq"] * beta2 + (1 - beta2) * gradient.square()
        if group.get("amsgrad"):
            after["max_exp_avg_sq"] = torch.maximum(state["max_exp_avg_sq"], after["exp_avg_sq"])
        after["step"] = _step_count(state) + 1
    return after


def _adafactor_state_after(group: dict, state: dict, gradient: torch.Tensor) -> dict:
    """Adafactor's state after its step t + 1 with `gradient`: R, C (or v) moved towards g^2's means over the last
    dimension, the one before it (or g^2) by (t + 1)^beta2_decay, as torch.optim.Adafactor's lerp."""
    after, step = dict(state), float(state["step"]) + 1.0
    weight = step ** float(group["beta2_decay"])  # 1 - beta2_t
    square = gradient.square()
    if "row_var" in state:
        after["row_var"] = state["row_var"].lerp(square.mean(dim=-1, keepdim=True), weight)
        after["col_var"] = state["col_var"].lerp(square.mean(dim=-2, keepdim=True), weight)
    else:
        after["variance"] = state["variance"].lerp(square, weight)
    after["step"] = step
    return after


def coupled_weight_decay(optimizer: torch.optim.Optimizer, group: dict) -> float:
    """The weight decay the optimizer adds to the gradient before it folds it into its state (wd theta): its
    weight_decay, unless decoupled (AdamW and Adafactor, theta times 1 - lr wd; NAdam and RAdam with
    decoupled_weight_decay), which shrinks theta outside."""
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adafactor))))
    return 0.0 if decoupled else float(group.get("weight_decay", 0.0))


def coming_step_denominator(optimizer: torch.optim.Optimizer, group: dict, state: dict | None, gradient: torch.Tensor,
                            param: torch.Tensor | None = None) -> torch.Tensor | None:
    """1 / P of the coming step for one parameter, `gradient` (as the optimizer sees it: with a coupled decay's wd theta)
    folded into a copy of its state as the step folds it (module docstring); None while it has no second moment.
    Adafactor's needs `param` (its relative step)."""
    if not state:
        return None
    return denominator(optimizer, group, _state_after(optimizer, group, state, gradient.detach()), param)


def coming_step_denominators(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                             gradients: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """coming_step_denominator per param, each with its loss gradient plus its group's coupled weight decay wd theta (what
    the optimizer folds in); None for a param without a gradient or without a second moment yet."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    denominators = []
    for param, gradient in zip(params, gradients, strict=True):
        group = group_of[id(param)]
        decay = coupled_weight_decay(optimizer, group)
        seen = None if gradient is None else (gradient + decay * param.detach() if decay else gradient)
        denominators.append(None if seen is None else coming_step_denominator(optimizer, group, optimizer.state.get(param), seen, param))
    return denominators


def coming_step_preconditioner(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                               gradients: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """P of the optimizer's coming step, flat in the order of the params that require a gradient, with `gradients` (one
    per such param: the loss's; coming_step_denominators adds a coupled decay's wd theta) folded into its state as the
    step folds them (module docstring); a param with no state yet gets 0, as in preconditioner_squares; None before the
    optimizer's first step."""
    params = [p for p in params if p.requires_grad]
    denominators = coming_step_denominators(optimizer, params, gradients)
    if all(d is None for d in denominators):
        return None
    return torch.cat([torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if d is None else d.reciprocal_().reshape(-1)
                      for p, d in zip(params, denominators)])  # fmt: skip
