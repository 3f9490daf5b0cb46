"""The stability headroom (profiler.sharpness): power iteration on Hessian-vector products against the exact
spectrum of a quadratic, and the threshold it reports against gradient descent's own divergence."""

import math

import pytest
import torch

from profiler.preconditioner import coming_step_preconditioner, preconditioner
from profiler.sharpness import radam_rectification, stability_headroom, stability_threshold_times_lr, top_hessian_eigenvalue


def _least_squares(seed=0, samples=64, features=6):
    """loss(w) = |X w - y|^2 / (2 n): Hessian X^T X / n, known exactly."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator, dtype=torch.float64) * torch.linspace(0.2, 2.0, features, dtype=torch.float64)
    targets = torch.randn(samples, generator=generator, dtype=torch.float64)
    weight = torch.nn.Parameter(torch.zeros(features, dtype=torch.float64))
    loss_fn = lambda: ((inputs @ weight - targets) ** 2).sum() / (2 * samples)  # noqa: E731
    hessian = inputs.T @ inputs / samples
    return weight, loss_fn, hessian


def _coming(optimizer, weight, loss_fn):
    """P of the optimizer's coming step with the gradient at the point (and a coupled decay's wd w) folded in."""
    (gradient,) = torch.autograd.grad(loss_fn(), [weight])
    return coming_step_preconditioner(optimizer, [weight], [gradient])


def test_power_iteration_finds_the_top_eigenvalue_of_the_hessian():
    weight, loss_fn, hessian = _least_squares()
    exact = float(torch.linalg.eigvalsh(hessian)[-1])
    assert top_hessian_eigenvalue(loss_fn, [weight], iterations=500, tolerance=0.0) == pytest.approx(exact, rel=1e-4)


def test_a_preconditioner_gives_the_top_eigenvalue_of_p_half_h_p_half():
    weight, loss_fn, hessian = _least_squares(seed=1)
    precond = torch.linspace(0.5, 3.0, hessian.shape[0], dtype=torch.float64)
    scale = precond.sqrt()
    exact = float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :])[-1])
    assert top_hessian_eigenvalue(loss_fn, [weight], precond, iterations=500, tolerance=0.0) == pytest.approx(exact, rel=1e-4)


def _indefinite(eigenvalues, seed=5):
    """loss(w) = w^T H w / 2 with H = Q diag(eigenvalues) Q^T, Q a random rotation: a saddle where some are negative."""
    generator = torch.Generator().manual_seed(seed)
    rotation, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=generator, dtype=torch.float64))
    hessian = rotation @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ rotation.T
    weight = torch.nn.Parameter(torch.randn(len(eigenvalues), generator=generator, dtype=torch.float64))
    return weight, lambda: weight @ hessian @ weight / 2, hessian


def test_where_a_negative_direction_dominates_the_shifted_iteration_still_finds_the_top_eigenvalue():
    """|lambda_min| = 5 > lambda_max = 2: plain power iteration converges to -5; the second run on H + 5 I finds 7 - 5.
    With SGD that gives a headroom (before: none, as if no direction were unstable)."""
    weight, loss_fn, hessian = _indefinite([-5.0, 2.0, 1.0, -0.5, 0.25])
    assert top_hessian_eigenvalue(loss_fn, [weight], iterations=500, tolerance=0.0) == pytest.approx(2.0, rel=1e-6)
    precond = torch.linspace(0.5, 2.0, 5, dtype=torch.float64)
    scale = precond.sqrt()
    exact = float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :])[-1])
    assert top_hessian_eigenvalue(loss_fn, [weight], precond, iterations=1000, tolerance=0.0) == pytest.approx(exact, rel=1e-6)
    measured = stability_headroom(loss_fn, [weight], torch.optim.SGD([weight], lr=0.1, momentum=0.9), iterations=500, tolerance=0.0)
    assert measured["sharpness"] == pytest.approx(2.0, rel=1e-6) and measured["stability_headroom"] == pytest.approx(3.8 / 0.2, rel=1e-6)


def test_a_hessian_with_no_positive_eigenvalue_gives_no_headroom():
    weight, loss_fn, _ = _indefinite([-5.0, -2.0, -1.0])
    assert top_hessian_eigenvalue(loss_fn, [weight], iterations=500, tolerance=0.0) == pytest.approx(-1.0, rel=1e-6)
    assert stability_headroom(loss_fn, [weight], torch.optim.SGD([weight], lr=0.1), iterations=500, tolerance=0.0) is None


def test_a_stale_second_moment_does_not_collapse_adams_headroom():
    """Adam warmed where weight[1] had no gradient (exp_avg_sq 0 there), then measured where it has one: the state's P
    would count its curvature at 1 / eps; the coming step's counts it at P ~ 1 / (sqrt(1 - beta2) |g|)."""
    weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    adam = torch.optim.Adam([weight], lr=1e-2)
    for _ in range(200):
        adam.zero_grad()
        (weight[0] - 1.0).square().backward()
        adam.step()
    loss_fn = lambda: (weight[0] - 1.0).square() + (weight[1] - 0.5).square()  # noqa: E731
    measured = stability_headroom(loss_fn, [weight], adam, iterations=500, tolerance=0.0)
    coming = _coming(adam, weight, loss_fn)
    assert measured["sharpness"] == pytest.approx(2.0 * float(coming.max()), rel=1e-6)
    assert measured["sharpness"] < 1e-4 * 2.0 / 1e-8  # the state's P there, 1 / eps, would give 2e8


def _descend(lr, momentum, steps=400, **settings):
    weight, loss_fn, _ = _least_squares(seed=2)
    optimizer = torch.optim.SGD([weight], lr=lr, momentum=momentum, **settings)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    return float(loss_fn().detach()), weight, loss_fn, optimizer


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_headroom_says_where_sgd_diverges(momentum):
    """On a quadratic the headroom is exact: an LR a little below headroom x lr trains, a little above diverges."""
    weight, loss_fn, hessian = _least_squares(seed=2)
    lam = float(torch.linalg.eigvalsh(hessian)[-1])
    probe = torch.optim.SGD([weight], lr=0.01, momentum=momentum)
    measured = stability_headroom(loss_fn, [weight], probe, iterations=500, tolerance=0.0)
    assert measured["sharpness"] == pytest.approx(lam, rel=1e-4)
    edge_lr = 0.01 * measured["stability_headroom"]
    assert edge_lr == pytest.approx((2 + 2 * momentum) / lam, rel=1e-4)
    below, *_ = _descend(0.95 * edge_lr, momentum)
    above, *_ = _descend(1.05 * edge_lr, momentum)
    start = float(loss_fn().detach())
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 0.0), (0.5, 0.0), (0.9, 0.3)])
def test_the_headroom_says_where_sgd_with_nesterov_momentum_and_weight_decay_diverges(momentum, weight_decay):
    """Nesterov's threshold (2 + 2 beta) / ((1 + 2 beta) eta), and coupled weight decay added to the Hessian: exact on a
    quadratic, as the heavy ball's is."""
    weight, loss_fn, hessian = _least_squares(seed=2)
    lam = float(torch.linalg.eigvalsh(hessian)[-1]) + weight_decay
    probe = torch.optim.SGD([weight], lr=0.01, momentum=momentum, nesterov=True, weight_decay=weight_decay)
    measured = stability_headroom(loss_fn, [weight], probe, iterations=500, tolerance=0.0)
    assert measured["sharpness"] == pytest.approx(lam, rel=1e-4)
    edge_lr = 0.01 * measured["stability_headroom"]
    assert edge_lr == pytest.approx((2 + 2 * momentum) / ((1 + 2 * momentum) * lam), rel=1e-4)
    settings = {"nesterov": True, "weight_decay": weight_decay}
    below, *_ = _descend(0.95 * edge_lr, momentum, **settings)
    above, *_ = _descend(1.05 * edge_lr, momentum, **settings)
    start = float(loss_fn().detach())
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


@pytest.mark.parametrize(("momentum", "dampening", "weight_decay"), [(0.9, 0.5, 0.0), (0.3, 0.5, 0.0), (0.9, 0.5, 0.3), (0.9, 0.8, 0.0)])
def test_the_headroom_says_where_sgd_with_dampened_momentum_diverges(momentum, dampening, weight_decay):
    """Dampening d: the buffer takes (1 - d) g after its first step (undampened), so the threshold is (2 + 2 beta) /
    ((1 - d) eta), exact on a quadratic, with coupled weight decay added to the Hessian."""
    weight, loss_fn, hessian = _least_squares(seed=2)
    lam = float(torch.linalg.eigvalsh(hessian)[-1]) + weight_decay
    settings = {"dampening": dampening, "weight_decay": weight_decay}
    probe = torch.optim.SGD([weight], lr=0.01, momentum=momentum, **settings)
    measured = stability_headroom(loss_fn, [weight], probe, iterations=500, tolerance=0.0)
    assert measured["sharpness"] == pytest.approx(lam, rel=1e-4)
    edge_lr = 0.01 * measured["stability_headroom"]
    assert edge_lr == pytest.approx((2 + 2 * momentum) / ((1 - dampening) * lam), rel=1e-4)
    below, *_ = _descend(0.95 * edge_lr, momentum, **settings)
    above, *_ = _descend(1.05 * edge_lr, momentum, **settings)
    start = float(loss_fn().detach())
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


def test_dampenings_threshold_and_where_it_has_none():
    """(2 + 2 beta) / (1 - d) for d < 1; None at d >= 1 (the buffer never takes the gradient, or takes its opposite) and
    for Nesterov with dampening (torch refuses it; only a group changed after the fact has it); without momentum torch
    ignores dampening: 2."""
    weight = torch.nn.Parameter(torch.zeros(2))
    assert stability_threshold_times_lr(torch.optim.SGD([weight], lr=0.1, momentum=0.9, dampening=0.5)) == pytest.approx(7.6)
    assert stability_threshold_times_lr(torch.optim.SGD([weight], lr=0.1, momentum=0.3, dampening=0.75)) == pytest.approx(10.4)
    assert stability_threshold_times_lr(torch.optim.SGD([weight], lr=0.1, momentum=0.0, dampening=0.5)) == 2.0
    for dampening in (1.0, 1.5):
        assert stability_threshold_times_lr(torch.optim.SGD([weight], lr=0.1, momentum=0.9, dampening=dampening)) is None
    nesterov = torch.optim.SGD([weight], lr=0.1, momentum=0.9, nesterov=True)
    nesterov.param_groups[0]["dampening"] = 0.5
    assert stability_threshold_times_lr(nesterov) is None


def test_plain_sgd_ignores_dampening_as_torch_does():
    """momentum 0: torch.optim.SGD keeps no buffer and steps by -eta g whatever the dampening: 2 / eta."""
    weight, loss_fn, hessian = _least_squares(seed=2)
    edge_lr = 2 / float(torch.linalg.eigvalsh(hessian)[-1])
    measured = stability_headroom(loss_fn, [weight], torch.optim.SGD([weight], lr=0.01, dampening=0.5), iterations=500, tolerance=0.0)
    assert 0.01 * measured["stability_headroom"] == pytest.approx(edge_lr, rel=1e-4)
    below, *_ = _descend(0.95 * edge_lr, 0.0, dampening=0.5)
    above, *_ = _descend(1.05 * edge_lr, 0.0, dampening=0.5)
    start = float(loss_fn().detach())
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


def test_decoupled_weight_decay_lowers_adamws_headroom_by_its_own_term():
    """AdamW's decay shrinks the weights outside the preconditioner: headroom c / (eta (lambda + c wd / 2)), c = 38 at
    beta1 0.9, where Adam's coupled decay adds wd to the Hessian it preconditions; no decay, no change."""
    weight, loss_fn, hessian = _least_squares(seed=3)
    adamw = torch.optim.AdamW([weight], lr=1e-2, weight_decay=0.0)
    adamw.zero_grad()
    loss_fn().backward()
    adamw.step()
    plain = stability_headroom(loss_fn, [weight], adamw, iterations=200, tolerance=0.0)
    adamw.param_groups[0]["weight_decay"] = 5.0  # the same weights and second moment, decayed
    decayed = stability_headroom(loss_fn, [weight], adamw, iterations=200, tolerance=0.0)
    threshold = 38.0 * (1 - 0.9**2)  # the second step's: torch's LR eta / (1 - beta1^t)
    assert decayed["sharpness"] == pytest.approx(plain["sharpness"], rel=1e-6)
    assert plain["stability_headroom"] == pytest.approx(threshold / (1e-2 * plain["sharpness"]))
    assert decayed["stability_headroom"] == pytest.approx(threshold / (1e-2 * (plain["sharpness"] + threshold * 5.0 / 2)))
    adam = torch.optim.Adam([weight], lr=1e-2, weight_decay=5.0)  # coupled: P^(1/2) (H + wd I) P^(1/2)
    adam.zero_grad()
    loss_fn().backward()
    adam.step()
    scale = _coming(adam, weight, loss_fn).sqrt()
    decayed_hessian = hessian + 5.0 * torch.eye(hessian.shape[0], dtype=hessian.dtype)
    expected = float(torch.linalg.eigvalsh(scale[:, None] * decayed_hessian * scale[None, :]).max())
    coupled = stability_headroom(loss_fn, [weight], adam, iterations=300, tolerance=0.0)
    assert coupled["sharpness"] == pytest.approx(expected, rel=1e-3)
    assert coupled["stability_headroom"] == pytest.approx(threshold / (1e-2 * expected), rel=1e-3)


def test_adam_has_a_threshold_from_beta1_and_no_headroom_before_its_first_step():
    weight, loss_fn, _ = _least_squares(seed=3)
    adam = torch.optim.Adam([weight], lr=1e-2, betas=(0.9, 0.999))
    assert stability_threshold_times_lr(adam) == pytest.approx(3.8, rel=1e-12)  # (2 + 2 beta1) (1 - beta1) / (1 - beta1)
    assert preconditioner(adam, [weight]) is None and stability_headroom(loss_fn, [weight], adam) is None
    adam.zero_grad()
    loss_fn().backward()
    adam.step()
    measured = stability_headroom(loss_fn, [weight], adam, iterations=100, tolerance=0.0)
    assert measured is not None and measured["stability_headroom"] == pytest.approx(38.0 * (1 - 0.9**2) / (1e-2 * measured["sharpness"]))
    for _ in range(300):
        adam.zero_grad()
        loss_fn().backward()
        adam.step()
    assert stability_threshold_times_lr(adam) == pytest.approx(38.0, rel=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_rmsprop_has_the_heavy_ball_threshold_on_its_preconditioned_hessian(momentum):
    weight, loss_fn, hessian = _least_squares(seed=4)
    rmsprop = torch.optim.RMSprop([weight], lr=1e-2, momentum=momentum)
    assert stability_threshold_times_lr(rmsprop) == pytest.approx(2.0 + 2.0 * momentum)
    assert stability_headroom(loss_fn, [weight], rmsprop) is None  # no second moment before its first step
    rmsprop.zero_grad()
    loss_fn().backward()
    rmsprop.step()
    measured = stability_headroom(loss_fn, [weight], rmsprop, iterations=200, tolerance=0.0)
    scale = _coming(rmsprop, weight, loss_fn).sqrt()
    expected = float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max())  # of P^(1/2) H P^(1/2)
    assert measured["sharpness"] == pytest.approx(expected, rel=1e-3)
    assert measured["stability_headroom"] == pytest.approx((2.0 + 2.0 * momentum) / (1e-2 * expected), rel=1e-3)


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_adafactor_has_gradient_descents_threshold_on_its_preconditioned_hessian(weight_decay):
    """Adafactor steps by -lr P g (its relative step in P; profiler.preconditioner), no momentum: 2 / lr on P^(1/2) H
    P^(1/2), its decoupled decay's lr wd / 2 off the threshold, as AdamW's; nothing before its first step."""
    weight, loss_fn, hessian = _least_squares(seed=4)
    adafactor = torch.optim.Adafactor([weight], lr=1e-2, weight_decay=weight_decay)
    assert stability_threshold_times_lr(adafactor) == 2.0
    assert stability_headroom(loss_fn, [weight], adafactor) is None
    for _ in range(3):
        adafactor.zero_grad()
        loss_fn().backward()
        adafactor.step()
    measured = stability_headroom(loss_fn, [weight], adafactor, iterations=200, tolerance=0.0)
    scale = _coming(adafactor, weight, loss_fn).sqrt()
    expected = float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max())  # no wd in H: decoupled
    assert measured["sharpness"] == pytest.approx(expected, rel=1e-3)
    assert measured["stability_headroom"] == pytest.approx(2.0 / (1e-2 * (expected + 2.0 * weight_decay / 2.0)), rel=1e-3)


def _warmed(optimizer_class, steps_taken, **settings):
    """The quadratic of seed 2 and an optimizer at lr 1e-2 that has taken `steps_taken` steps on it."""
    weight, loss_fn, _ = _least_squares(seed=2)
    optimizer = optimizer_class([weight], lr=1e-2, **settings)
    for _ in range(steps_taken):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    return weight, loss_fn, optimizer


def _exp_avg_sq_giving(optimizer, state, gradient, denominator):
    """The exp_avg_sq x to hold before a step so that the step divides by `denominator`: the step makes it
    v = beta2 x + (1 - beta2) g^2 at t + 1, and divides by sqrt(v / (1 - beta2^(t+1))) + eps (NAdam) or by
    (sqrt(v) + eps) / sqrt(1 - beta2^(t+1)) (RAdam) (torch.optim.NAdam, torch.optim.RAdam)."""
    group = optimizer.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    bias_correction = 1 - beta2 ** (float(state["step"]) + 1)
    if isinstance(optimizer, torch.optim.RAdam):
        second_moment = (denominator * bias_correction**0.5 - eps) ** 2
    else:
        second_moment = (denominator - eps) ** 2 * bias_correction
    return (second_moment - (1 - beta2) * gradient**2) / beta2


def _frozen_run(weight, loss_fn, optimizer, lr, steps=300):
    """The loss after `steps` steps at `lr` that are all the coming step: its step count, NAdam's mu_product and the
    coming step's preconditioner (with the gradient now folded in) are put back before each one, so the steps are one linear iteration, whose edge the
    threshold is. Adamax's u is held as its state has it (exp_inf = u / beta2, so max(beta2 exp_inf, |g| + eps) = u),
    which holds while |g| + eps <= u: the run stops where a gradient has outgrown it."""
    state, group = optimizer.state[weight], optimizer.param_groups[0]
    frozen = {key: state[key].clone() for key in ("step", "mu_product") if key in state}
    coupled_decay = 0.0 if group.get("decoupled_weight_decay", False) else group["weight_decay"]
    denominator = 1 / _coming(optimizer, weight, loss_fn)
    held_infinity_norm = denominator if "exp_inf" in state else None
    held_sum = (denominator - group["eps"]) ** 2 if "sum" in state else None
    group["lr"] = lr
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn().backward()
        for key, value in frozen.items():
            state[key].copy_(value)
        gradient = weight.grad + coupled_decay * weight.detach()
        if held_sum is not None:  # Adagrad: sum + g^2 = held_sum, while the gradient has not outgrown it
            if bool((gradient**2 > held_sum).any()):
                break
            state["sum"].copy_(held_sum - gradient**2)
        elif held_infinity_norm is None:
            state["exp_avg_sq"].copy_(_exp_avg_sq_giving(optimizer, state, gradient, denominator))
        elif bool((gradient.abs() + group["eps"] > held_infinity_norm).any()):
            break
        else:
            state["exp_inf"].copy_(held_infinity_norm / group["betas"][1])
        optimizer.step()
    return float(loss_fn().detach())


@pytest.mark.parametrize(
    ("optimizer_class", "steps_taken", "settings"),
    [
        (torch.optim.NAdam, 50, {"momentum_decay": 100.0}),  # mu_t ~ beta1 from the second step on
        (torch.optim.NAdam, 10, {}),  # the default momentum_decay: mu_t ~ beta1 / 2 still
        (torch.optim.NAdam, 2, {"momentum_decay": 5.0}),  # mu_t 0.53, 0.60, 0.66 at t = 1, 2, 3: the coming step's
        (torch.optim.NAdam, 10, {"weight_decay": 1.0}),
        (torch.optim.NAdam, 10, {"weight_decay": 10.0, "decoupled_weight_decay": True}),
        (torch.optim.RAdam, 20, {}),
        (torch.optim.RAdam, 8, {"weight_decay": 1.0}),  # just rectified: 1 - beta1^9 = 0.61
        (torch.optim.RAdam, 20, {"weight_decay": 0.3, "decoupled_weight_decay": True}),
    ],
    ids=["nadam-ramped", "nadam-default", "nadam-ramping", "nadam-coupled-decay", "nadam-decoupled-decay", "radam", "radam-coupled-decay", "radam-decoupled-decay"],
)
def test_the_headroom_says_where_nadam_and_radam_diverge(optimizer_class, steps_taken, settings):
    """With the coming step's coefficients and preconditioner held, the headroom is exact on a quadratic: 0.95x the edge
    LR trains, 1.05x diverges; the sharpness is that of P^(1/2) (H + wd I) P^(1/2) with coupled decay, of P^(1/2) H
    P^(1/2) with decoupled."""
    weight, loss_fn, optimizer = _warmed(optimizer_class, steps_taken, **settings)
    measured = stability_headroom(loss_fn, [weight], optimizer, iterations=500, tolerance=0.0)
    coupled_decay = 0.0 if settings.get("decoupled_weight_decay") else settings.get("weight_decay", 0.0)
    hessian = _least_squares(seed=2)[2] + coupled_decay * torch.eye(6, dtype=torch.float64)
    scale = _coming(optimizer, weight, loss_fn).sqrt()
    assert measured["sharpness"] == pytest.approx(float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max()), rel=1e-4)
    edge_lr = 1e-2 * measured["stability_headroom"]
    start = float(loss_fn().detach())
    below = _frozen_run(*_warmed(optimizer_class, steps_taken, **settings), lr=0.95 * edge_lr)
    above = _frozen_run(*_warmed(optimizer_class, steps_taken, **settings), lr=1.05 * edge_lr)
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


ADAMAX_HELD_NORM_FACTOR = 1e6  # u held this far above the warm-up's, so a diverging run's gradient can grow as much under it


def _warmed_adamax(steps_taken, **settings):
    """_warmed's Adamax with its u scaled by ADAMAX_HELD_NORM_FACTOR: P and the edge LR scale by its inverse and by it,
    so eta P, and the iteration on the quadratic, are the same."""
    weight, loss_fn, optimizer = _warmed(torch.optim.Adamax, steps_taken, **settings)
    optimizer.state[weight]["exp_inf"].mul_(ADAMAX_HELD_NORM_FACTOR)
    return weight, loss_fn, optimizer


@pytest.mark.parametrize(
    ("steps_taken", "settings"),
    [(20, {}), (3, {}), (5, {"betas": (0.5, 0.99)}), (10, {"weight_decay": 1.0})],
    ids=["adamax", "adamax-early", "adamax-beta1-0.5", "adamax-coupled-decay"],
)
def test_the_headroom_says_where_adamax_diverges(steps_taken, settings):
    """Adamax's edge is Adam's with its LR eta / (1 - beta1^t): (2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) eta) on
    P^(1/2) (H + wd I) P^(1/2), P = 1 / u, for the coming step t (1 - 0.9^4 = 0.34 at t = 4); with u and t held, 0.95x
    the edge LR trains and 1.05x diverges on a quadratic."""
    weight, loss_fn, optimizer = _warmed_adamax(steps_taken, **settings)
    beta1, step = optimizer.param_groups[0]["betas"][0], steps_taken + 1
    measured = stability_headroom(loss_fn, [weight], optimizer, iterations=500, tolerance=0.0)
    hessian = _least_squares(seed=2)[2] + settings.get("weight_decay", 0.0) * torch.eye(6, dtype=torch.float64)
    scale = _coming(optimizer, weight, loss_fn).sqrt()  # 1 / max(beta2 u, |g| + eps)
    assert measured["sharpness"] == pytest.approx(float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max()), rel=1e-4)
    edge_lr = 1e-2 * measured["stability_headroom"]
    assert edge_lr == pytest.approx((2 + 2 * beta1) * (1 - beta1**step) / ((1 - beta1) * measured["sharpness"]), rel=1e-9)
    start = float(loss_fn().detach())
    below = _frozen_run(*_warmed_adamax(steps_taken, **settings), lr=0.95 * edge_lr)
    above = _frozen_run(*_warmed_adamax(steps_taken, **settings), lr=1.05 * edge_lr)
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


ADAGRAD_HELD_SUM_FACTOR = 1e12  # the sum held this far above the warm-up's (its root 1e6), so a diverging gradient can grow under it


def _warmed_adagrad(steps_taken, **settings):
    """_warmed's Adagrad with its sum scaled by ADAGRAD_HELD_SUM_FACTOR: P scales by its inverse root and the edge LR by
    that root, so eta P, and the iteration on the quadratic, are the same."""
    weight, loss_fn, optimizer = _warmed(torch.optim.Adagrad, steps_taken, **settings)
    optimizer.state[weight]["sum"].mul_(ADAGRAD_HELD_SUM_FACTOR)
    return weight, loss_fn, optimizer


@pytest.mark.parametrize(
    ("steps_taken", "settings"),
    [(20, {}), (1, {}), (5, {"lr_decay": 0.5}), (10, {"weight_decay": 1.0})],
    ids=["adagrad", "adagrad-early", "adagrad-lr-decay", "adagrad-coupled-decay"],
)
def test_the_headroom_says_where_adagrad_diverges(steps_taken, settings):
    """Adagrad's edge is gradient descent's with its LR eta / (1 + (t - 1) lr_decay): 2 (1 + (t - 1) lr_decay) / eta on
    P^(1/2) (H + wd I) P^(1/2), P = 1 / (sqrt(sum + g^2) + eps), for the coming step t; with the sum and t held, 0.95x
    the edge LR trains and 1.05x diverges on a quadratic."""
    weight, loss_fn, optimizer = _warmed_adagrad(steps_taken, **settings)
    step = steps_taken + 1
    measured = stability_headroom(loss_fn, [weight], optimizer, iterations=500, tolerance=0.0)
    hessian = _least_squares(seed=2)[2] + settings.get("weight_decay", 0.0) * torch.eye(6, dtype=torch.float64)
    scale = _coming(optimizer, weight, loss_fn).sqrt()  # 1 / (sqrt(sum + g^2) + eps)
    assert measured["sharpness"] == pytest.approx(float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max()), rel=1e-4)
    edge_lr = 1e-2 * measured["stability_headroom"]
    assert edge_lr == pytest.approx(2 * (1 + (step - 1) * settings.get("lr_decay", 0.0)) / measured["sharpness"], rel=1e-9)
    start = float(loss_fn().detach())
    below = _frozen_run(*_warmed_adagrad(steps_taken, **settings), lr=0.95 * edge_lr)
    above = _frozen_run(*_warmed_adagrad(steps_taken, **settings), lr=1.05 * edge_lr)
    assert below < start and (above > 1e3 * start or not math.isfinite(above))


def test_adagrad_has_no_headroom_before_its_first_step_though_its_state_is_there():
    """Adagrad's state exists from the start (step 0, sum 0) but holds no gradient: no P and no headroom before the first
    step, as for the others; after it, the coming step's P folds the gradient into the sum."""
    weight, loss_fn, _ = _least_squares(seed=3)
    adagrad = torch.optim.Adagrad([weight], lr=1e-2)
    assert stability_threshold_times_lr(adagrad) == 2.0
    assert preconditioner(adagrad, [weight]) is None and _coming(adagrad, weight, loss_fn) is None
    assert stability_headroom(loss_fn, [weight], adagrad) is None
    adagrad.zero_grad()
    loss_fn().backward()
    first = weight.grad.clone()
    adagrad.step()
    (gradient,) = torch.autograd.grad(loss_fn(), [weight])
    assert torch.allclose(_coming(adagrad, weight, loss_fn), 1 / ((first**2 + gradient**2).sqrt() + 1e-10), rtol=1e-12)
    assert stability_headroom(loss_fn, [weight], adagrad) is not None


def test_adamaxs_threshold_follows_its_bias_correction_and_it_has_no_headroom_before_its_first_step():
    """(2 + 2 beta1) (1 - beta1^t) / (1 - beta1) for the coming step: 3.8 at t = 1, 38 (1 - 0.9^4) at t = 4."""
    weight, loss_fn, _ = _least_squares(seed=3)
    adamax = torch.optim.Adamax([weight], lr=1e-2)
    assert stability_threshold_times_lr(adamax) == pytest.approx(3.8, rel=1e-12)
    assert preconditioner(adamax, [weight]) is None and stability_headroom(loss_fn, [weight], adamax) is None
    for _ in range(3):
        adamax.zero_grad()
        loss_fn().backward()
        adamax.step()
    assert stability_threshold_times_lr(adamax) == pytest.approx(38.0 * (1 - 0.9**4), rel=1e-12)


def test_nadams_threshold_weighs_its_gradient_and_momentum_terms():
    """(2 + 2 beta1) / (c1 (1 + beta1) + c2 (1 - beta1)) for the coming step: before the first, t = 1, c1 = 1 and
    c2 = mu_2 / (1 - mu_1 mu_2); once mu_t = beta1 and mu_1...mu_t ~ 0, Nesterov's (2 + 2 beta1) / (1 + 2 beta1) over
    1 - beta1: 13.57 at beta1 0.9, not Adam's 38."""
    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    nadam = torch.optim.NAdam([weight], lr=1e-2, betas=(0.9, 0.999), momentum_decay=0.05)
    mu_1, mu_2 = (0.9 * (1 - 0.5 * 0.96 ** (step * 0.05)) for step in (1, 2))
    assert stability_threshold_times_lr(nadam) == pytest.approx(3.8 / (1.9 + 0.1 * mu_2 / (1 - mu_1 * mu_2)), rel=1e-12)
    nadam.param_groups[0]["momentum_decay"] = 100.0
    for _ in range(300):
        nadam.zero_grad()
        weight.square().sum().backward()
        nadam.step()
    assert stability_threshold_times_lr(nadam) == pytest.approx(3.8 / (2.8 * 0.1), rel=1e-6)


def test_radam_has_no_threshold_before_its_rectification():
    """rho_t <= 5 for t <= 5 at beta2 0.999: those steps are not preconditioned, so no threshold; the sixth step's is
    Adam's over rect_6 / (1 - beta1^6)."""
    weight, loss_fn, _ = _least_squares(seed=3)
    radam = torch.optim.RAdam([weight], lr=1e-2, betas=(0.9, 0.999))
    for _ in range(5):
        assert stability_threshold_times_lr(radam) is None and stability_headroom(loss_fn, [weight], radam) is None
        radam.zero_grad()
        loss_fn().backward()
        radam.step()
    rho_inf, rho_6 = 2 / 0.001 - 1, 2 / 0.001 - 1 - 12 * 0.999**6 / (1 - 0.999**6)
    rect_6 = math.sqrt((rho_6 - 4) * (rho_6 - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_6))
    assert radam_rectification(0.999, 5) is None and radam_rectification(0.999, 6) == pytest.approx(rect_6, rel=1e-12)
    assert stability_threshold_times_lr(radam) == pytest.approx(38.0 * (1 - 0.9**6) / rect_6, rel=1e-12)
    assert stability_headroom(loss_fn, [weight], radam, iterations=50) is not None


@pytest.mark.parametrize("optimizer_class", [torch.optim.NAdam, torch.optim.RAdam])
def test_nadam_and_radam_decay_as_their_decoupled_weight_decay_says(optimizer_class):
    """decoupled_weight_decay False: wd joins the Hessian that P preconditions, as Adam's; True: the sharpness is
    unchanged and the headroom is c / (eta (lambda + c wd / 2)), as AdamW's."""
    weight, loss_fn, optimizer = _warmed(optimizer_class, 10)
    group = optimizer.param_groups[0]
    threshold = stability_threshold_times_lr(optimizer)
    plain = stability_headroom(loss_fn, [weight], optimizer, iterations=300, tolerance=0.0)
    group["weight_decay"], group["decoupled_weight_decay"] = 5.0, True
    decoupled = stability_headroom(loss_fn, [weight], optimizer, iterations=300, tolerance=0.0)
    group["decoupled_weight_decay"] = False
    coupled = stability_headroom(loss_fn, [weight], optimizer, iterations=300, tolerance=0.0)
    scale = _coming(optimizer, weight, loss_fn).sqrt()
    decayed_hessian = _least_squares(seed=2)[2] + 5.0 * torch.eye(6, dtype=torch.float64)
    expected = float(torch.linalg.eigvalsh(scale[:, None] * decayed_hessian * scale[None, :]).max())
    assert decoupled["sharpness"] == pytest.approx(plain["sharpness"], rel=1e-9)
    assert decoupled["stability_headroom"] == pytest.approx(threshold / (1e-2 * (plain["sharpness"] + threshold * 5.0 / 2)), rel=1e-9)
    assert coupled["sharpness"] == pytest.approx(expected, rel=1e-4) and coupled["sharpness"] > 1.5 * plain["sharpness"]
    assert coupled["stability_headroom"] == pytest.approx(threshold / (1e-2 * coupled["sharpness"]), rel=1e-9)


def test_optimizers_without_a_known_threshold_get_no_headroom():
    weight, loss_fn, _ = _least_squares()
    assert stability_threshold_times_lr(torch.optim.SGD([weight], lr=0.1, momentum=0.9, dampening=1.0)) is None
    assert stability_headroom(loss_fn, [weight], torch.optim.Adadelta([weight], lr=0.1)) is None


def test_attention_layers_have_a_second_derivative_here():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True, dropout=0.0)
    inputs = torch.randn(4, 5, 8)
    loss_fn = lambda: layer(inputs).pow(2).mean()  # noqa: E731
    assert math.isfinite(top_hessian_eigenvalue(loss_fn, list(layer.parameters()), iterations=3))
