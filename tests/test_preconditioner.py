"""profiler.preconditioner: P = 1 / (sqrt(v) + eps) read from Adam's, AdamW's, RMSprop's, NAdam's and RAdam's state, and
Adamax's P = 1 / u; and the coming step's P, with its gradient folded in."""

import math

import pytest
import torch

from profiler.preconditioner import coming_step_preconditioner, denominator, is_adaptive, preconditioner, preconditioner_squares


def _stepped(optimizer_class, steps: int = 1, **options) -> tuple[torch.nn.Linear, torch.optim.Optimizer, list[torch.Tensor]]:
    """A layer stepped `steps` times by the optimizer; the flat gradient of each step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = optimizer_class(layer.parameters(), lr=1e-3, **options)
    gradients = []
    for step in range(steps):
        optimizer.zero_grad()
        layer(torch.randn(5, 3, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        gradients.append(torch.cat([p.grad.reshape(-1).clone() for p in layer.parameters()]))
        optimizer.step()
    return layer, optimizer, gradients


def _next_update(optimizer_class, steps_taken: int, **options) -> tuple[torch.optim.Optimizer, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """A float64 layer stepped `steps_taken` times, then once more: the optimizer, the layer, and the flat update and
    flat gradient of that last step. The state after it is the one that step divided by (its second moment, its t)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2, dtype=torch.float64)
    optimizer = optimizer_class(layer.parameters(), lr=1e-3, **options)
    for step in range(steps_taken + 1):
        before = torch.cat([p.detach().reshape(-1).clone() for p in layer.parameters()])
        optimizer.zero_grad()
        layer(torch.randn(5, 3, generator=torch.Generator().manual_seed(step), dtype=torch.float64)).square().mean().backward()
        gradient = torch.cat([p.grad.reshape(-1).clone() for p in layer.parameters()])
        optimizer.step()
    update = torch.cat([p.detach().reshape(-1) for p in layer.parameters()]) - before
    return optimizer, layer, update, gradient


def _flat_state(optimizer, layer, key) -> torch.Tensor:
    return torch.cat([optimizer.state[p][key].reshape(-1) for p in layer.parameters()])


def _flat_denominator(optimizer, layer) -> torch.Tensor:
    group = optimizer.param_groups[0]
    return torch.cat([denominator(optimizer, group, optimizer.state[p]).reshape(-1) for p in layer.parameters()])


def test_adam_after_one_step_divides_by_the_gradients_own_size():
    layer, optimizer, (gradient,) = _stepped(torch.optim.Adam)
    # after one step v_hat = g^2 exactly (v_1 = (1 - beta2) g^2, corrected by 1 - beta2)
    expected = 1 / (gradient.abs() + optimizer.param_groups[0]["eps"])
    assert torch.allclose(preconditioner(optimizer, list(layer.parameters())), expected, rtol=1e-5)


def test_amsgrad_reads_the_running_maximum():
    layer, optimizer, gradients = _stepped(torch.optim.AdamW, steps=3, amsgrad=True)
    beta2, eps = optimizer.param_groups[0]["betas"][1], optimizer.param_groups[0]["eps"]
    exp_avg_sq, maximum = torch.zeros_like(gradients[0]), torch.zeros_like(gradients[0])
    for gradient in gradients:
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * gradient**2
        maximum = torch.maximum(maximum, exp_avg_sq)
    expected = 1 / ((maximum / (1 - beta2**3)).sqrt() + eps)
    assert torch.allclose(preconditioner(optimizer, list(layer.parameters())), expected, rtol=1e-5)


@pytest.mark.parametrize("centered", [False, True])
def test_rmsprop_reads_its_uncorrected_mean_square_centered_or_not(centered):
    layer, optimizer, gradients = _stepped(torch.optim.RMSprop, steps=4, centered=centered)
    alpha, eps = optimizer.param_groups[0]["alpha"], optimizer.param_groups[0]["eps"]
    square_avg, grad_avg = torch.zeros_like(gradients[0]), torch.zeros_like(gradients[0])
    for gradient in gradients:  # torch.optim.RMSprop: no bias correction
        square_avg = alpha * square_avg + (1 - alpha) * gradient**2
        grad_avg = alpha * grad_avg + (1 - alpha) * gradient
    second_moment = square_avg - grad_avg**2 if centered else square_avg
    expected = 1 / (second_moment.sqrt() + eps)
    assert torch.allclose(preconditioner(optimizer, list(layer.parameters())), expected, rtol=1e-4)
    group, state = optimizer.param_groups[0], optimizer.state[layer.weight]
    assert torch.allclose(denominator(optimizer, group, state), second_moment[:6].view(2, 3).sqrt() + eps, rtol=1e-4)


def test_nadam_steps_by_its_two_terms_over_the_denominator_read_from_its_state():
    """torch.optim.NAdam: theta -= lr (c1 g + c2 m) / (sqrt(v / (1 - beta2^t)) + eps), c1 = (1 - mu_t) / (1 - mu_1...mu_t),
    c2 = mu_{t+1} / (1 - mu_1...mu_{t+1}), mu_t = beta1 (1 - 0.5 0.96^(t psi)); a large eps tells its place in the sum."""
    optimizer, layer, update, gradient = _next_update(torch.optim.NAdam, 4, eps=0.1, momentum_decay=0.5)
    beta1, psi, lr = optimizer.param_groups[0]["betas"][0], 0.5, 1e-3
    mu = [beta1 * (1 - 0.5 * 0.96 ** (step * psi)) for step in range(7)]  # mu[t]; this step is t = 5
    mu_product = math.prod(mu[1:6])
    c1, c2 = (1 - mu[5]) / (1 - mu_product), mu[6] / (1 - mu_product * mu[6])
    expected = -lr * (c1 * gradient + c2 * _flat_state(optimizer, layer, "exp_avg")) / _flat_denominator(optimizer, layer)
    assert torch.allclose(update, expected, rtol=1e-9, atol=0)


def test_radam_steps_by_its_rectified_update_over_the_denominator_read_from_its_state():
    """torch.optim.RAdam, rectified (rho_t > 5): theta -= lr rect_t m_hat sqrt(1 - beta2^t) / (sqrt(v) + eps), so its
    denominator is (sqrt(v) + eps) / sqrt(1 - beta2^t), eps outside the bias correction (a large eps tells)."""
    optimizer, layer, update, _ = _next_update(torch.optim.RAdam, 7, eps=0.1)
    (beta1, beta2), lr, step = optimizer.param_groups[0]["betas"], 1e-3, 8
    rho_inf = 2 / (1 - beta2) - 1
    rho = rho_inf - 2 * step * beta2**step / (1 - beta2**step)
    rect = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
    m_hat = _flat_state(optimizer, layer, "exp_avg") / (1 - beta1**step)
    expected = -lr * rect * m_hat / _flat_denominator(optimizer, layer)
    assert rho > 5 and torch.allclose(update, expected, rtol=1e-9, atol=0)


def test_radam_before_its_rectification_steps_unpreconditioned_yet_has_a_preconditioner():
    optimizer, layer, update, _ = _next_update(torch.optim.RAdam, 2)  # t = 3: rho_3 = 3.0 <= 5
    beta1 = optimizer.param_groups[0]["betas"][0]
    assert torch.allclose(update, -1e-3 * _flat_state(optimizer, layer, "exp_avg") / (1 - beta1**3), rtol=1e-9, atol=0)
    assert bool((preconditioner(optimizer, list(layer.parameters())) > 0).all())


def test_adamax_reads_its_infinity_norm_with_eps_added_to_each_gradients_size():
    """torch.optim.Adamax: u = max(beta2 u, |g| + eps), eps inside the max, and P = 1 / u (no eps added again: a large eps
    tells); none before its first step."""
    layer = torch.nn.Linear(3, 2)
    assert preconditioner(torch.optim.Adamax(layer.parameters()), list(layer.parameters())) is None
    layer, optimizer, gradients = _stepped(torch.optim.Adamax, steps=4, eps=0.1)
    beta2 = optimizer.param_groups[0]["betas"][1]
    infinity_norm = torch.zeros_like(gradients[0])
    for gradient in gradients:
        infinity_norm = torch.maximum(beta2 * infinity_norm, gradient.abs() + 0.1)
    assert torch.allclose(preconditioner(optimizer, list(layer.parameters())), 1 / infinity_norm, rtol=1e-6)


def test_adamax_steps_by_its_first_moment_over_the_denominator_read_from_its_state():
    """torch.optim.Adamax: theta -= lr / (1 - beta1^t) m / u, the step t = 5 dividing by the u its state holds after it."""
    optimizer, layer, update, _ = _next_update(torch.optim.Adamax, 4, eps=0.1, weight_decay=0.5)
    beta1, lr = optimizer.param_groups[0]["betas"][0], 1e-3
    expected = -lr / (1 - beta1**5) * _flat_state(optimizer, layer, "exp_avg") / _flat_denominator(optimizer, layer)
    assert torch.allclose(update, expected, rtol=1e-9, atol=0)


def test_adagrad_reads_the_root_of_every_past_squared_gradient_and_steps_by_it():
    """torch.optim.Adagrad: sum = sum_t g_t^2 (not a moving average), P = 1 / (sqrt(sum) + eps), the step -lr / (1 + (t - 1)
    lr_decay) P g; nothing before its first step, though its state (step 0, sum 0) is there from the start."""
    layer = torch.nn.Linear(3, 2)
    assert preconditioner(torch.optim.Adagrad(layer.parameters()), list(layer.parameters())) is None
    layer, optimizer, gradients = _stepped(torch.optim.Adagrad, steps=4, eps=0.1)
    squares = torch.stack(gradients).square().sum(0)
    assert torch.allclose(preconditioner(optimizer, list(layer.parameters())), 1 / (squares.sqrt() + 0.1), rtol=1e-6)
    optimizer, layer, update, gradient = _next_update(torch.optim.Adagrad, 4, eps=0.1, lr_decay=0.5)
    assert torch.allclose(update, -1e-3 / (1 + 4 * 0.5) * gradient / _flat_denominator(optimizer, layer), rtol=1e-9, atol=0)


def _adafactor_layers() -> tuple[list[torch.nn.Parameter], callable]:
    """A float64 linear layer (a factored weight, a vector bias) and a conv layer (a 4-d weight, factored over its
    kernel's two dimensions), and a loss on fixed inputs."""
    torch.manual_seed(0)
    linear, conv = torch.nn.Linear(5, 3, dtype=torch.float64), torch.nn.Conv2d(2, 3, 3, dtype=torch.float64)
    inputs = torch.randn(8, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    images = torch.randn(4, 2, 5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return [*linear.parameters(), *conv.parameters()], lambda: linear(inputs).square().mean() + conv(images).square().mean()


@pytest.mark.parametrize(("lr", "weight_decay"), [(1e-2, 0.0), (0.5, 0.0), (1e-2, 0.3)], ids=["lr-capped", "one-over-sqrt-t", "decoupled-decay"])
def test_adafactor_steps_by_its_relative_step_over_its_factored_second_moment(lr, weight_decay):
    """torch.optim.Adafactor with clipping out of reach (d = 1e6): every step is theta (1 - lr wd) - lr P g, P = max(eps2,
    RMS(theta)) min(1, 1 / (lr sqrt(t))) / max(sqrt(V_hat), eps1) of the coming step (its gradient folded into R and C, or
    a vector's v, by t^-0.8), theta the parameter before the step; at lr 0.5, 1 / sqrt(t) is below lr from the fifth
    step. Nothing before the first step (its state is made by it); its decay is decoupled (no wd theta in the state)."""
    params, loss_fn = _adafactor_layers()
    optimizer = torch.optim.Adafactor(params, lr=lr, d=1e6, weight_decay=weight_decay)
    assert preconditioner(optimizer, params) is None
    assert coming_step_preconditioner(optimizer, params, [torch.ones_like(p) for p in params]) is None
    checked = 0
    for _ in range(8):
        optimizer.zero_grad()
        loss_fn().backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in params])
        before = torch.cat([p.detach().reshape(-1) for p in params])
        coming = coming_step_preconditioner(optimizer, params, [p.grad for p in params])
        optimizer.step()
        after = torch.cat([p.detach().reshape(-1) for p in params])
        if coming is not None:
            assert torch.allclose(after, before * (1 - lr * weight_decay) - lr * coming * gradient, rtol=1e-12, atol=1e-15)
            checked += 1
    assert checked == 7  # every step but the first
    assert preconditioner(optimizer, params) is not None


def test_adafactors_preconditioner_needs_its_parameter():
    params, loss_fn = _adafactor_layers()
    optimizer = torch.optim.Adafactor(params)
    loss_fn().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="pass the parameter"):
        denominator(optimizer, optimizer.param_groups[0], optimizer.state[params[0]])


def test_nothing_before_the_first_step_and_zero_for_a_parameter_without_a_gradient_yet():
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.RMSprop(layer.parameters(), lr=1e-3)
    assert preconditioner(optimizer, list(layer.parameters())) is None
    layer.bias.requires_grad_(False)
    layer(torch.randn(5, 3)).sum().backward()
    layer.bias.requires_grad_(True)  # the bias took no step: no state
    optimizer.step()
    weight_square, bias_square = preconditioner_squares(optimizer, list(layer.parameters()))
    assert bool((weight_square > 0).all()) and bool((bias_square == 0).all())


def test_which_optimizers_are_adaptive():
    weight = torch.nn.Parameter(torch.zeros(2))
    adaptive = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                torch.optim.Adagrad, torch.optim.Adafactor)
    assert all(is_adaptive(make([weight], lr=0.1)) for make in adaptive)
    assert not any(is_adaptive(make([weight], lr=0.1)) for make in (torch.optim.SGD, torch.optim.Adadelta)) and not is_adaptive(None)


COMING_STEP_CASES = [
    (torch.optim.Adam, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.Adam, {"weight_decay": 0.5}),
    (torch.optim.AdamW, {"weight_decay": 0.5}), (torch.optim.NAdam, {}), (torch.optim.RAdam, {}), (torch.optim.RMSprop, {}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.9}), (torch.optim.Adamax, {}), (torch.optim.Adamax, {"weight_decay": 0.5}),
    (torch.optim.Adagrad, {}), (torch.optim.Adagrad, {"weight_decay": 0.5}),
]


@pytest.mark.parametrize(("optimizer_class", "options"), COMING_STEP_CASES,
                         ids=["adam", "adam-amsgrad", "adam-coupled-decay", "adamw", "nadam", "radam", "rmsprop", "rmsprop-centered",
                              "adamax", "adamax-coupled-decay", "adagrad", "adagrad-coupled-decay"])  # fmt: skip
def test_the_coming_steps_preconditioner_is_the_one_its_step_divides_by(optimizer_class, options):
    """coming_step_preconditioner(state before, g) = preconditioner(state after torch's step with g): the step's own
    gradient folded into the second moment (Adamax: the infinity norm) at t + 1, with a coupled decay's wd theta added
    as the optimizer adds it (AdamW's decoupled decay not); the state is not changed by the read."""
    layer, optimizer, _ = _stepped(optimizer_class, steps=4, **options)
    params = list(layer.parameters())
    optimizer.zero_grad()
    layer(torch.randn(5, 3, generator=torch.Generator().manual_seed(99))).square().mean().backward()
    state_before = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()} for p in params}
    coming = coming_step_preconditioner(optimizer, params, [p.grad for p in params])  # the decay's wd theta: added inside
    for p in params:
        for key, value in state_before[id(p)].items():
            assert torch.equal(optimizer.state[p][key], value) if torch.is_tensor(value) else optimizer.state[p][key] == value
    optimizer.step()
    assert torch.allclose(coming, preconditioner(optimizer, params), rtol=1e-5, atol=0.0)
    assert not torch.allclose(coming, _preconditioner_of(state_before, optimizer, params), rtol=1e-3, atol=0.0)


def _preconditioner_of(states: dict, optimizer: torch.optim.Optimizer, params: list) -> torch.Tensor:
    group = optimizer.param_groups[0]
    return torch.cat([denominator(optimizer, group, states[id(p)]).reciprocal().reshape(-1) for p in params])


def test_a_stale_coordinate_counts_at_the_size_its_coming_step_gives_it_not_at_one_over_eps():
    """A coordinate with no gradient for a while (a ReLU unit come back) keeps exp_avg_sq = 0, so the state's P there is
    1 / eps = 1e8; Adam's coming step folds in (1 - beta2) g^2 first and divides by at least sqrt(1 - beta2) |g|."""
    weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    adam = torch.optim.Adam([weight], lr=1e-2)
    for _ in range(20):
        adam.zero_grad()
        (weight[0] - 1.0).square().backward()  # no gradient for weight[1]: its second moment stays 0
        adam.step()
    assert float(preconditioner(adam, [weight])[1]) == pytest.approx(1e8)
    gradient = torch.tensor([0.0, 0.3], dtype=torch.float64)
    coming = coming_step_preconditioner(adam, [weight], [gradient])
    bias_correction = 1 - 0.999**21
    assert float(coming[1]) == pytest.approx(1 / ((0.001 * 0.09 / bias_correction) ** 0.5 + 1e-8), rel=1e-9)
    assert float(coming[1]) < 1e3


def test_the_coming_step_has_no_preconditioner_before_the_first_step_and_zero_for_a_parameter_without_state():
    layer = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(layer.parameters(), lr=1e-3)
    params = list(layer.parameters())
    assert coming_step_preconditioner(adam, params, [torch.ones_like(p) for p in params]) is None
    layer.weight.grad = torch.ones_like(layer.weight)  # the bias has no gradient: no state
    adam.step()
    coming = coming_step_preconditioner(adam, params, [torch.ones_like(p) for p in params])
    assert bool((coming[: layer.weight.numel()] > 0).all()) and bool((coming[layer.weight.numel():] == 0).all())
