"""profiler.preconditioner: P = 1 / (sqrt(v) + eps) read from Adam's, AdamW's and RMSprop's state."""

import pytest
import torch

from profiler.preconditioner import denominator, is_adaptive, preconditioner, preconditioner_squares


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
    assert all(is_adaptive(make([weight], lr=0.1)) for make in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop))
    assert not any(is_adaptive(make([weight], lr=0.1)) for make in (torch.optim.SGD, torch.optim.Adagrad)) and not is_adaptive(None)
