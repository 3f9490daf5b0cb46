"""How far the learning rate can rise before the optimizer leaves its stable range: the stability headroom.

The LR rule raises the LR with the batch (the AdaScale gain). Whether the raised LR still trains is a
question about the loss surface, which the gradient noise scale does not answer: on plain SGD the rule's
2.1x LR at 4x the reference batch took 2.8x the epochs of the best LR there (benchmarks/advised_lr.py).
This module measures the answer from the run itself.

Sharpness. lambda_max, the largest eigenvalue of the Hessian H of the training loss (of P^(1/2) H P^(1/2)
for Adam, AdamW and RMSprop, P = 1 / (sqrt(v) + eps), the optimizer's own preconditioner: profiler.preconditioner), by power iteration on
Hessian-vector products (Pearlmutter 1994): v <- H v / |H v|, lambda = v . H v, from a fixed random start.

Stability threshold (on a quadratic, the update diverges along the top eigenvector above it):
- gradient descent:                       lambda_max < 2 / eta
- heavy-ball momentum beta (PyTorch's):   lambda_max < (2 + 2 beta) / eta
- Nesterov momentum beta (PyTorch's):     lambda_max < (2 + 2 beta) / ((1 + 2 beta) eta), from the characteristic
  polynomial z^2 - (1 + beta - a (1 + beta)) z + beta (1 - a) of its update on a quadratic (a = eta lambda) at z = -1
- Adam/AdamW with beta1 (preconditioned): lambda_max < (2 + 2 beta1) / ((1 - beta1) eta)
- RMSprop with heavy-ball momentum mu (preconditioned; mu = 0 by default): lambda_max < (2 + 2 mu) / eta, the
  momentum form on P^(1/2) H P^(1/2), as its update is the heavy ball's on the preconditioned gradient
(Cohen et al. 2021, "Gradient Descent on Neural Networks Typically Occurs at the Edge of Stability";
Cohen et al. 2022, "Adaptive Gradient Methods at the Edge of Stability", for the momentum and Adam forms.)

    headroom = threshold / lambda_max = (2 + 2 beta) / (eta lambda_max)   [/ (1 - beta1) for Adam]

Weight decay wd (the optimizer's weight_decay). Coupled (SGD, Adam, RMSprop: the gradient is g + wd theta), it adds wd
to the Hessian: lambda_max is that of H + wd I (of P^(1/2) (H + wd I) P^(1/2)). Decoupled (AdamW: theta shrinks by
(1 - eta wd) a step, outside the preconditioner), the same characteristic polynomial at z = -1 gives
eta lambda_max < c (1 - eta wd / 2), c = eta threshold, so the LR can grow by c / (eta (lambda_max + c wd / 2)).
Both are exact on a quadratic with the preconditioner frozen, and small where wd << lambda_max.

is the factor by which the LR can grow, at the sharpness of this moment, before the top direction is
unstable. It is a lower bound on what trains, not an upper one: sharpness adapts to the LR (it falls back
towards 2 / eta when the LR rises past it, the edge of stability), and a warm-up gives it time to. So the
service uses it to cap the LR it advises, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from profiler.preconditioner import is_adaptive
from profiler.preconditioner import preconditioner as optimizer_preconditioner

POWER_ITERATIONS = 20
RELATIVE_TOLERANCE = 1e-3  # stop when lambda moves less than this between iterations


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def top_hessian_eigenvalue(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    preconditioner: torch.Tensor | None = None,
    iterations: int = POWER_ITERATIONS,
    seed: int = 0,
    tolerance: float = RELATIVE_TOLERANCE,
    weight_decay: float = 0.0,
) -> float:
    """lambda_max of the Hessian of loss_fn() in params plus weight_decay I (of P^(1/2) (H + weight_decay I) P^(1/2)
    when preconditioner P, a flat tensor in the order of params, is given), by power iteration on Hessian-vector products, until lambda moves
    by less than tolerance (relative) or after `iterations`. loss_fn builds
    the loss anew (one forward pass); the gradient graph is kept for the iterations. Attention layers run in
    PyTorch's math kernel here, because the fused CPU kernels have no second derivative."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = [p for p in params if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH):
        grad = _flat(torch.autograd.grad(loss_fn(), params, create_graph=True))
        scale = preconditioner.detach().sqrt() if preconditioner is not None else None
        vector = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(seed), dtype=grad.dtype)
        vector = vector.to(grad.device) / vector.norm()
        eigenvalue = math.nan
        for _ in range(iterations):
            probe = vector * scale if scale is not None else vector
            product = _flat(torch.autograd.grad(grad @ probe, params, retain_graph=True)).detach()
            if weight_decay:
                product = product + weight_decay * probe
            if scale is not None:
                product = product * scale
            previous, eigenvalue = eigenvalue, float(vector @ product)
            norm = float(product.norm())
            if not math.isfinite(norm) or norm == 0.0:
                break
            vector = product / norm
            if math.isfinite(previous) and abs(eigenvalue - previous) <= tolerance * abs(eigenvalue):
                break
    return eigenvalue


def stability_threshold_times_lr(optimizer: torch.optim.Optimizer) -> float | None:
    """eta * (the largest stable lambda_max) for the optimizer's first param group (module docstring): 2 + 2
    beta for SGD (beta = momentum, 0 for plain SGD) and RMSprop (its momentum), (2 + 2 beta) / (1 + 2 beta) for
    SGD with Nesterov momentum, (2 + 2 beta1) / (1 - beta1) for Adam/AdamW. None where no threshold is known here
    (dampened momentum, other optimizers)."""
    group = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.RMSprop):
        return 2.0 + 2.0 * float(group.get("momentum", 0.0))
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("dampening", 0.0):
            return None
        momentum = float(group.get("momentum", 0.0))
        return (2.0 + 2.0 * momentum) / (1.0 + 2.0 * momentum if group.get("nesterov") else 1.0)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        beta1 = float(group["betas"][0])
        return (2.0 + 2.0 * beta1) / (1.0 - beta1)
    return None


def stability_headroom(loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                       iterations: int = POWER_ITERATIONS, tolerance: float = RELATIVE_TOLERANCE) -> dict[str, float] | None:
    """The headroom threshold / lambda_max at the optimizer's current LR (module docstring, with its weight decay), with
    lambda_max (of H + wd I where the decay is coupled) and that LR; None where no threshold is known, before an
    adaptive optimizer's first step, or when lambda_max <= 0 (no unstable direction at this point)."""
    threshold_times_lr = stability_threshold_times_lr(optimizer)
    if threshold_times_lr is None:
        return None
    params = [p for p in params if p.requires_grad]
    preconditioner = None
    if is_adaptive(optimizer):
        preconditioner = optimizer_preconditioner(optimizer, params)
        if preconditioner is None:
            return None
    group = optimizer.param_groups[0]
    weight_decay = float(group.get("weight_decay", 0.0))
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    eigenvalue = top_hessian_eigenvalue(loss_fn, params, preconditioner, iterations, tolerance=tolerance,
                                        weight_decay=0.0 if decoupled else weight_decay)  # fmt: skip
    lr = float(group["lr"])
    if not (math.isfinite(eigenvalue) and eigenvalue > 0.0 and lr > 0.0):
        return None
    decay_term = threshold_times_lr * weight_decay / 2.0 if decoupled else 0.0
    return {"stability_headroom": threshold_times_lr / (lr * (eigenvalue + decay_term)), "sharpness": eigenvalue, "lr": lr}
