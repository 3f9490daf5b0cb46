"""The stability headroom (profiler.sharpness): power iteration on Hessian-vector products against the exact
spectrum of a quadratic, and the threshold it reports against gradient descent's own divergence."""

import math

import pytest
import torch

from profiler.preconditioner import preconditioner
from profiler.sharpness import stability_headroom, stability_threshold_times_lr, top_hessian_eigenvalue


def _least_squares(seed=0, samples=64, features=6):
    """loss(w) = |X w - y|^2 / (2 n): Hessian X^T X / n, known exactly."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator, dtype=torch.float64) * torch.linspace(0.2, 2.0, features, dtype=torch.float64)
    targets = torch.randn(samples, generator=generator, dtype=torch.float64)
    weight = torch.nn.Parameter(torch.zeros(features, dtype=torch.float64))
    loss_fn = lambda: ((inputs @ weight - targets) ** 2).sum() / (2 * samples)  # noqa: E731
    hessian = inputs.T @ inputs / samples
    return weight, loss_fn, hessian


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
    assert decayed["sharpness"] == pytest.approx(plain["sharpness"], rel=1e-6)
    assert plain["stability_headroom"] == pytest.approx(38.0 / (1e-2 * plain["sharpness"]))
    assert decayed["stability_headroom"] == pytest.approx(38.0 / (1e-2 * (plain["sharpness"] + 38.0 * 5.0 / 2)))
    adam = torch.optim.Adam([weight], lr=1e-2, weight_decay=5.0)  # coupled: P^(1/2) (H + wd I) P^(1/2)
    adam.zero_grad()
    loss_fn().backward()
    adam.step()
    scale = preconditioner(adam, [weight]).sqrt()
    decayed_hessian = hessian + 5.0 * torch.eye(hessian.shape[0], dtype=hessian.dtype)
    expected = float(torch.linalg.eigvalsh(scale[:, None] * decayed_hessian * scale[None, :]).max())
    coupled = stability_headroom(loss_fn, [weight], adam, iterations=300, tolerance=0.0)
    assert coupled["sharpness"] == pytest.approx(expected, rel=1e-3)
    assert coupled["stability_headroom"] == pytest.approx(38.0 / (1e-2 * expected), rel=1e-3)


def test_adam_has_a_threshold_from_beta1_and_no_headroom_before_its_first_step():
    weight, loss_fn, _ = _least_squares(seed=3)
    adam = torch.optim.Adam([weight], lr=1e-2, betas=(0.9, 0.999))
    assert stability_threshold_times_lr(adam) == pytest.approx(38.0)
    assert preconditioner(adam, [weight]) is None and stability_headroom(loss_fn, [weight], adam) is None
    adam.zero_grad()
    loss_fn().backward()
    adam.step()
    measured = stability_headroom(loss_fn, [weight], adam, iterations=100, tolerance=0.0)
    assert measured is not None and measured["stability_headroom"] == pytest.approx(38.0 / (1e-2 * measured["sharpness"]))


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
    scale = preconditioner(rmsprop, [weight]).sqrt()
    expected = float(torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max())  # of P^(1/2) H P^(1/2)
    assert measured["sharpness"] == pytest.approx(expected, rel=1e-3)
    assert measured["stability_headroom"] == pytest.approx((2.0 + 2.0 * momentum) / (1e-2 * expected), rel=1e-3)


def test_optimizers_without_a_known_threshold_get_no_headroom():
    weight, loss_fn, _ = _least_squares()
    assert stability_threshold_times_lr(torch.optim.SGD([weight], lr=0.1, momentum=0.9, dampening=0.5)) is None
    assert stability_headroom(loss_fn, [weight], torch.optim.Adagrad([weight], lr=0.1)) is None


def test_attention_layers_have_a_second_derivative_here():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True, dropout=0.0)
    inputs = torch.randn(4, 5, 8)
    loss_fn = lambda: layer(inputs).pow(2).mean()  # noqa: E731
    assert math.isfinite(top_hessian_eigenvalue(loss_fn, list(layer.parameters()), iterations=3))
