"""How far the learning rate can rise before the optimizer leaves its stable range: the stability headroom.

The LR rule raises the LR with the batch (the AdaScale gain). Whether the raised LR still trains is a
question about the loss surface, which the gradient noise scale does not answer: on plain SGD the rule's
2.1x LR at 4x the reference batch took 2.8x the epochs of the best LR there (benchmarks/advised_lr.py).
This module measures the answer from the run itself.

Sharpness. lambda_max, the largest eigenvalue of the Hessian H of the training loss (of P^(1/2) H P^(1/2)
for Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, Adagrad and Adafactor, P = 1 / (sqrt(v) + eps), RAdam's sqrt(1 - beta2^t) /
(sqrt(exp_avg_sq) + eps), Adamax's 1 / u, Adagrad's 1 / (sqrt(sum) + eps), Adafactor's relative step over max(sqrt(V_hat),
eps1), the optimizer's own preconditioner: profiler.preconditioner), by power
iteration on Hessian-vector products (Pearlmutter 1994): v <- H v / |H v|, lambda = v . H v, from a fixed random start.
Power iteration finds the eigenvalue of largest magnitude. Where that is negative (a saddle's direction outweighs the
sharpest one), a second run on H - lambda_neg I, whose eigenvalues lie in [0, lambda_max - lambda_neg], gives lambda_max
as its top eigenvalue plus lambda_neg (the shift: Golub & Van Loan, "Matrix Computations", sec. 7.3); before it the
read was "no headroom" wherever a negative direction dominated (4 of 256 reads of the CPU tasks' reference runs).
P is that of the coming step, with the gradient at the point folded into the optimizer's second moment as its step
will fold it (profiler.preconditioner.coming_step_preconditioner): a coordinate whose second moment is stale, far
below its gradient now, would otherwise count at up to 1 / eps.

Stability threshold (on a quadratic, the update diverges along the top eigenvector above it):
- gradient descent:                       lambda_max < 2 / eta
- heavy-ball momentum beta (PyTorch's):   lambda_max < (2 + 2 beta) / eta
- heavy-ball momentum beta with dampening d (torch.optim.SGD: buf = beta buf + (1 - d) g, the step -eta buf; its first
  step sets buf = g, undampened, so this is the edge of every later step): the update's characteristic polynomial on a
  quadratic, z^2 - (1 + beta - (1 - d) a) z + beta (a = eta lambda), is 2 + 2 beta - (1 - d) a at z = -1 and
  (1 - d) a > 0 at z = 1, and complex roots have |z|^2 = beta < 1, so for d < 1
      lambda_max < (2 + 2 beta) / ((1 - d) eta)
  (d = 0 gives the heavy ball's; at d >= 1 the buffer takes no gradient, or its opposite: no threshold; without
  momentum torch ignores d: 2 / eta; torch refuses Nesterov with d != 0)
- Nesterov momentum beta (PyTorch's):     lambda_max < (2 + 2 beta) / ((1 + 2 beta) eta), from the characteristic
  polynomial z^2 - (1 + beta - a (1 + beta)) z + beta (1 - a) of its update on a quadratic (a = eta lambda) at z = -1
- Adam/AdamW with beta1 (preconditioned): lambda_max < (2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) eta) for the coming
  step t (torch steps by eta / (1 - beta1^t), which lowers the threshold of step t by 1 - beta1^t: 0.1 at t = 1, 0.65
  at t = 10; (2 + 2 beta1) / ((1 - beta1) eta) once beta1^t ~ 0)
- RMSprop with heavy-ball momentum mu (preconditioned; mu = 0 by default): lambda_max < (2 + 2 mu) / eta, the
  momentum form on P^(1/2) H P^(1/2), as its update is the heavy ball's on the preconditioned gradient
- NAdam (preconditioned; Dozat 2016, torch.optim.NAdam): m = beta1 m + (1 - beta1) g, then the step
  -eta P (c1 g + c2 m), with c1 = (1 - mu_t) / (1 - mu_product_t), c2 = mu_{t+1} / (1 - mu_product_t mu_{t+1}),
  mu_t = beta1 (1 - 0.5 0.96^(t psi)) (psi = momentum_decay), mu_product_t = mu_1 ... mu_t. On a quadratic (a = eta
  lambda, u = eta P m): theta' = (1 - a c1) theta - c2 u, u = beta1 u_prev + (1 - beta1) a theta, whose characteristic
  polynomial z^2 - (1 + beta1 - a (c1 + c2 (1 - beta1))) z + beta1 (1 - c1 a) leaves the unit circle at z = -1
  (at z = 1 it is a (1 - beta1)(c1 + c2) > 0, and complex roots have |z|^2 = beta1 (1 - c1 a) < 1 below this edge):
      lambda_max < (2 + 2 beta1) / ((c1 (1 + beta1) + c2 (1 - beta1)) eta)
  (c1 = 0, c2 = 1 gives Adam's; mu_t -> beta1, mu_product_t -> 0 gives (2 + 2 beta1) / ((1 + 2 beta1) (1 - beta1)
  eta), Nesterov's over 1 - beta1; at the default psi = 0.004, mu_t stays within 0.5-0.58 beta1 for the first
  thousand steps, and at beta1 0.9 the threshold is 3.5 / eta at t = 10-100 and 3.9 / eta at t = 1000, where Adam's
  is 38 / eta: NAdam weights the fresh gradient by c1 ~ 1 - mu_t, not 1 - beta1)
- RAdam (preconditioned; Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and Beyond", alg. 2,
  torch.optim.RAdam): Adam's step on m_hat = m / (1 - beta1^t) with the LR times rect_t, rect_t = sqrt((rho_t - 4)
  (rho_t - 2) rho_inf / ((rho_inf - 4) (rho_inf - 2) rho_t)), rho_inf = 2 / (1 - beta2) - 1, rho_t = rho_inf -
  2 t beta2^t / (1 - beta2^t), so Adam's threshold with eta rect_t / (1 - beta1^t) for eta:
      lambda_max < (2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) rect_t eta)
  At beta2 0.999 rect_t rises from 0.026 at t = 6 to 0.65 at t = 1000: this is 18x Adam's threshold at t = 6 and
  1.5x at t = 1000. While rho_t <= 5 (t <= 5 at beta2 0.999) its step is eta m_hat, not preconditioned: no
  threshold is given for it.
- Adamax (preconditioned, P = 1 / u; Kingma & Ba 2015, sec. 7.1, torch.optim.Adamax): m = beta1 m + (1 - beta1) g,
  u = max(beta2 u, |g| + eps), the step -eta / (1 - beta1^t) m / u: Adam's with P = 1 / u and the LR eta /
  (1 - beta1^t), whose polynomial z^2 - (1 + beta1 - (1 - beta1) a') z + beta1 (a' = a / (1 - beta1^t)) gives
      lambda_max < (2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) eta)
  (torch's bias correction applied here, unlike Adam's above: it lowers the first steps' threshold, 1 - beta1^t = 0.1,
  0.65 and 0.99997 at t = 1, 10 and 100 at beta1 0.9)
- Adagrad (preconditioned, P = 1 / (sqrt(sum) + eps), sum the accumulated g^2; Duchi et al. 2011, torch.optim.Adagrad):
  no momentum, the step -eta / (1 + (t - 1) lr_decay) P g, so gradient descent's edge with that LR:
      lambda_max < 2 (1 + (t - 1) lr_decay) / eta
- Adafactor (preconditioned, P = max(eps2, RMS(theta)) min(1, 1 / (eta sqrt(t))) / max(sqrt(V_hat), eps1), its relative
  step over its factored second moment; Shazeer & Stern 2018, torch.optim.Adafactor): no momentum, the step -eta P g,
  so gradient descent's edge, lambda_max < 2 / eta (the 1 / sqrt(t) decay of its relative step is in P). Its update
  clipping, left out of P, can only shrink a step. As for Adagrad and centered RMSprop, a run can train past this
  edge (its P moves as a direction grows; its second moment by 1 - beta2_t = t^-0.8, 0.025 at t = 100): along the
  digits MLP's reference run the headroom read 0.15-1.4, and the run reached its target (docs/validation.md)
NAdam's, RAdam's, Adamax's and Adagrad's coefficients change with the step t; each threshold is the one of the coming step,
t = the state's step + 1 (the first parameter's that has a state; t = 1, mu_product_0 = 1 before any step).
(Cohen et al. 2021, "Gradient Descent on Neural Networks Typically Occurs at the Edge of Stability";
Cohen et al. 2022, "Adaptive Gradient Methods at the Edge of Stability", for the momentum and Adam forms.)

    headroom = threshold / lambda_max = (2 + 2 beta) / (eta lambda_max)   [/ (1 - beta1) for Adam]

Weight decay wd (the optimizer's weight_decay). Coupled (SGD, Adam, RMSprop, Adamax, and NAdam and RAdam with
decoupled_weight_decay False: the gradient is g + wd theta), it adds wd to the Hessian: lambda_max is that of H + wd I
(of P^(1/2) (H + wd I) P^(1/2)). Decoupled (AdamW, Adafactor, and NAdam and RAdam with decoupled_weight_decay True: theta shrinks
by (1 - eta wd) a step, before and outside the preconditioned step), the same characteristic polynomial at z = -1 gives
eta lambda_max < c (1 - eta wd / 2), c = eta threshold, so the LR can grow by c / (eta (lambda_max + c wd / 2)) (for
NAdam, delta = eta wd: theta' = (1 - delta - a c1) theta - c2 u, so the polynomial is z^2 - (1 + beta1 - delta - a
(c1 + c2 (1 - beta1))) z + beta1 (1 - delta - a c1), and at z = -1 (1 + beta1)(2 - delta) = a (c1 (1 + beta1) + c2
(1 - beta1)): the threshold times (1 - delta / 2), as for Adam and RAdam (c1 = 0)).
Both are exact on a quadratic with the preconditioner frozen, and small where wd << lambda_max.

is the factor by which the LR can grow, at the sharpness of this moment, before the top direction is
unstable. It is a lower bound on what trains, not an upper one: sharpness adapts to the LR (it falls back
towards 2 / eta when the LR rises past it, the edge of stability), and a warm-up gives it time to. So the
service uses it to cap the LR it advises, and says so.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from profiler.preconditioner import coming_step_preconditioner, coupled_weight_decay, is_adaptive

POWER_ITERATIONS = 20
RELATIVE_TOLERANCE = 1e-3  # stop when lambda moves less than this between iterations


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def top_hessian_eigenvalue(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    preconditioner: torch.Tensor | Callable[[Sequence[torch.Tensor]], torch.Tensor | None] | None = None,
    iterations: int = POWER_ITERATIONS,
    seed: int = 0,
    tolerance: float = RELATIVE_TOLERANCE,
    weight_decay: float = 0.0,
) -> float:
    """lambda_max, the largest eigenvalue of the Hessian of loss_fn() in params plus weight_decay I (of P^(1/2) (H +
    weight_decay I) P^(1/2) when preconditioner P, a flat tensor in the order of params, is given, or a function of the
    gradients at the point, one per param, that returns it), by power iteration on Hessian-vector products, until
    lambda moves by less than tolerance (relative) or after `iterations`; where the eigenvalue of largest magnitude is
    negative, by a second, shifted run (module docstring). NaN when P is None. loss_fn builds the loss anew (one
    forward pass); the gradient graph is kept for the iterations. Attention layers run in PyTorch's math kernel here,
    because the fused CPU kernels have no second derivative."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = [p for p in params if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH):
        gradients = torch.autograd.grad(loss_fn(), params, create_graph=True)
        if callable(preconditioner):
            preconditioner = preconditioner([g.detach() for g in gradients])
            if preconditioner is None:
                return math.nan
        grad = _flat(gradients)
        scale = preconditioner.detach().sqrt() if preconditioner is not None else None

        def operator(vector: torch.Tensor) -> torch.Tensor:
            probe = vector * scale if scale is not None else vector
            product = _flat(torch.autograd.grad(grad @ probe, params, retain_graph=True)).detach()
            if weight_decay:
                product = product + weight_decay * probe
            return product * scale if scale is not None else product

        start = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(seed), dtype=grad.dtype).to(grad.device)
        eigenvalue = _power_iteration(operator, start, iterations, tolerance)
        if math.isfinite(eigenvalue) and eigenvalue < 0.0:
            eigenvalue = _power_iteration(operator, start, iterations, tolerance, shift=eigenvalue)
    return eigenvalue


def _power_iteration(operator: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, iterations: int, tolerance: float,
                     shift: float = 0.0) -> float:
    """The eigenvalue of largest magnitude of operator - shift I, plus shift (the Rayleigh quotient v . A v of the last
    iterate), until it moves by less than tolerance (relative) or after `iterations`; NaN if no product was finite."""
    vector = start / start.norm()
    eigenvalue = math.nan
    for _ in range(iterations):
        product = operator(vector)
        if shift:
            product = product - shift * vector
        previous, eigenvalue = eigenvalue, float(vector @ product) + shift
        norm = float(product.norm())
        if not math.isfinite(norm) or norm == 0.0:
            break
        vector = product / norm
        if math.isfinite(previous) and abs(eigenvalue - previous) <= tolerance * abs(eigenvalue):
            break
    return eigenvalue


def nadam_momentum_weights(beta1: float, momentum_decay: float, steps_taken: float, mu_product: float) -> tuple[float, float]:
    """(c1, c2), the weights of g and of m in NAdam's coming step t = steps_taken + 1 (torch.optim.NAdam), from the
    mu_product of the steps taken: c1 = (1 - mu_t) / (1 - mu_product_t), c2 = mu_{t+1} / (1 - mu_product_t mu_{t+1}),
    mu_product_t = mu_product mu_t, mu_t = beta1 (1 - 0.5 0.96^(t momentum_decay))."""
    mu_now, mu_next = (beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay)) for step in (steps_taken + 1, steps_taken + 2))
    mu_product_now = mu_product * mu_now
    return (1.0 - mu_now) / (1.0 - mu_product_now), mu_next / (1.0 - mu_product_now * mu_next)


def radam_rectification(beta2: float, step: float) -> float | None:
    """RAdam's rect_t at step t (Liu et al. 2020, alg. 2; torch.optim.RAdam): sqrt((rho_t - 4) (rho_t - 2) rho_inf /
    ((rho_inf - 4) (rho_inf - 2) rho_t)), rho_inf = 2 / (1 - beta2) - 1, rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t);
    None while rho_t <= 5, where the step is not preconditioned (torch's cut; the paper's is 4)."""
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho = rho_inf - 2.0 * step * beta2**step / (1.0 - beta2**step)
    if rho <= 5.0:
        return None
    return math.sqrt((rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho))


def _first_state(optimizer: torch.optim.Optimizer) -> dict:
    """The state of the first parameter of the first param group that has taken a step; {} before any."""
    for param in optimizer.param_groups[0]["params"]:
        state = optimizer.state.get(param)
        if state and "step" in state:
            return state
    return {}


def stability_threshold_times_lr(optimizer: torch.optim.Optimizer) -> float | None:
    """eta * (the largest stable lambda_max) for the optimizer's first param group (module docstring): 2 + 2
    beta for SGD (beta = momentum, 0 for plain SGD) and RMSprop (its momentum), (2 + 2 beta) / (1 - d) for SGD with
    dampening d, (2 + 2 beta) / (1 + 2 beta) for SGD with Nesterov momentum, (2 + 2 beta1) (1 - beta1^t) / (1 - beta1)
    for the coming step t of Adam, AdamW and Adamax (one form: torch steps all three by eta / (1 - beta1^t)), (2 + 2
    beta1) / (c1 (1 + beta1) + c2 (1 - beta1)) for NAdam's, (2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) rect_t) for
    RAdam's, 2 (1 + (t - 1) lr_decay) for Adagrad's, 2 for Adafactor's (its relative step is in its P). None where no
    threshold is known here (dampening d >= 1, RAdam's un-rectified first steps, other optimizers)."""
    group = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.Adafactor):
        return 2.0
    if isinstance(optimizer, torch.optim.Adagrad):
        return 2.0 * (1.0 + float(_first_state(optimizer).get("step", 0.0)) * float(group["lr_decay"]))
    if isinstance(optimizer, torch.optim.NAdam):
        return _nadam_threshold_times_lr(group, _first_state(optimizer))
    if isinstance(optimizer, torch.optim.RAdam):
        return _radam_threshold_times_lr(group, _first_state(optimizer))
    if isinstance(optimizer, torch.optim.RMSprop):
        return 2.0 + 2.0 * float(group.get("momentum", 0.0))
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd_threshold_times_lr(group)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax)):
        return _bias_corrected_adam_threshold_times_lr(float(group["betas"][0]), float(_first_state(optimizer).get("step", 0.0)) + 1.0)
    return None


def _sgd_threshold_times_lr(group: dict) -> float | None:
    """2 without momentum (torch.optim.SGD then ignores dampening), (2 + 2 beta) / (1 + 2 beta) with Nesterov momentum,
    (2 + 2 beta) / (1 - d) with heavy-ball momentum beta and dampening d < 1; None for d >= 1, and for Nesterov with
    d != 0 (torch refuses it)."""
    momentum = float(group.get("momentum", 0.0))
    if momentum == 0.0:
        return 2.0
    dampening = float(group.get("dampening", 0.0))
    if group.get("nesterov"):
        return None if dampening else (2.0 + 2.0 * momentum) / (1.0 + 2.0 * momentum)
    if dampening >= 1.0:
        return None
    return (2.0 + 2.0 * momentum) / (1.0 - dampening)


def _bias_corrected_adam_threshold_times_lr(beta1: float, step: float) -> float:
    """(2 + 2 beta1) (1 - beta1^t) / (1 - beta1) at step t: Adam's form with torch's LR eta / (1 - beta1^t)."""
    return (2.0 + 2.0 * beta1) * (1.0 - beta1**step) / (1.0 - beta1)


def _nadam_threshold_times_lr(group: dict, state: dict) -> float:
    """(2 + 2 beta1) / (c1 (1 + beta1) + c2 (1 - beta1)), c1 and c2 of the coming step (nadam_momentum_weights)."""
    beta1 = float(group["betas"][0])
    c1, c2 = nadam_momentum_weights(beta1, float(group["momentum_decay"]), float(state.get("step", 0.0)), float(state.get("mu_product", 1.0)))
    return (2.0 + 2.0 * beta1) / (c1 * (1.0 + beta1) + c2 * (1.0 - beta1))


def _radam_threshold_times_lr(group: dict, state: dict) -> float | None:
    """(2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) rect_t) for the coming step t; None while it is not rectified."""
    beta1, beta2 = (float(beta) for beta in group["betas"])
    step = float(state.get("step", 0.0)) + 1.0
    rectification = radam_rectification(beta2, step)
    if rectification is None:
        return None
    return _bias_corrected_adam_threshold_times_lr(beta1, step) / rectification


@contextlib.contextmanager
def training_left_as_it_was(buffers: Sequence[torch.Tensor], device: torch.device) -> Iterator[None]:
    """Around a measurement's forward pass inside a training run: torch's random generators (CPU, and `device`'s when it
    is a GPU: dropout's masks) and `buffers` (the model's: batch norm's running statistics) are as they were after it,
    so the run trains on exactly as it would have without the measurement."""
    kept = [buffer.detach().clone() for buffer in buffers]
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for buffer, before in zip(buffers, kept):
                buffer.copy_(before)


def stability_headroom(loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                       iterations: int = POWER_ITERATIONS, tolerance: float = RELATIVE_TOLERANCE) -> dict[str, float] | None:
    """The headroom threshold / lambda_max at the optimizer's current LR (module docstring, with its weight decay), with
    lambda_max (of H + wd I where the decay is coupled) and that LR; None where no threshold is known, before an
    adaptive optimizer's first step, or when lambda_max <= 0 (no unstable direction at this point)."""
    threshold_times_lr = stability_threshold_times_lr(optimizer)
    if threshold_times_lr is None:
        return None
    params = [p for p in params if p.requires_grad]
    group = optimizer.param_groups[0]
    weight_decay = float(group.get("weight_decay", 0.0))
    coupled_decay = coupled_weight_decay(optimizer, group)
    decoupled = weight_decay > 0.0 and coupled_decay == 0.0
    # the coming step's P, the gradients at the point folded in (with a coupled decay's wd theta)
    preconditioner = partial(coming_step_preconditioner, optimizer, params) if is_adaptive(optimizer) else None
    eigenvalue = top_hessian_eigenvalue(loss_fn, params, preconditioner, iterations, tolerance=tolerance, weight_decay=coupled_decay)
    lr = float(group["lr"])
    if not (math.isfinite(eigenvalue) and eigenvalue > 0.0 and lr > 0.0):
        return None
    decay_term = threshold_times_lr * weight_decay / 2.0 if decoupled else 0.0
    return {"stability_headroom": threshold_times_lr / (lr * (eigenvalue + decay_term)), "sharpness": eigenvalue, "lr": lr}
