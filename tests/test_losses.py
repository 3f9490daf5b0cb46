"""The training loss a spec names (models.losses): catalog losses on float targets, a user loss behind the
allowlist, and the contract that keeps each a mean over the batch (the noise estimator's premise)."""

import pytest
import torch

from models.losses import loss_function, mean_squared_error, multi_label_loss, next_token_loss
from models.registry import LOSSES, loss_problem
from models.user_contract import TensorPairSource, batch_problem, check
from models.workload import build_workload
from profiler.measure import profile_point
from tests.handmade import spec_dict
from tests.test_user_contract import ALLOWED, FIXTURE, _errors
from tula_service.dispatch.jobs import point_request
from tula_service.spec.job_spec import JobSpec

REGRESSION = {"name": f"{FIXTURE}:regression_signals", "num_samples": 400}
MULTI_LABEL = {"name": f"{FIXTURE}:multi_label_signals", "num_samples": 400}


# --- the losses and their targets ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_catalog_loss_is_the_mean_of_its_halves(name):
    """The estimator's premise: the loss of a batch is the mean of its two halves' losses (so is its gradient)."""
    generator = torch.Generator().manual_seed(0)
    if name == "cross_entropy":
        outputs, targets = torch.randn(6, 4, generator=generator), torch.randint(0, 4, (6,), generator=generator)
    else:
        outputs, targets = torch.randn(6, 3, generator=generator), torch.rand(6, 3, generator=generator)
    loss = loss_function(name, "signal1d")
    whole, halves = loss(outputs, targets), [loss(outputs[:3], targets[:3]), loss(outputs[3:], targets[3:])]
    assert float(whole) == pytest.approx(float(sum(halves)) / 2, rel=1e-6)


def test_the_default_loss_is_cross_entropy_and_next_token_on_tokens():
    assert loss_function(None, "tokens") is next_token_loss and loss_function("cross_entropy", "tokens") is next_token_loss
    assert loss_function("mse", "image") is mean_squared_error and loss_function("bce_with_logits", "signal1d") is multi_label_loss
    outputs, targets = torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0, 0.0]])
    assert float(mean_squared_error(outputs, targets)) == pytest.approx((1 + 4) / 2)
    with pytest.raises(KeyError, match=r"loss 'mae' is not in the catalog; did you mean mse\?; known: bce_with_logits, cross_entropy, l1, mse"):
        loss_function("mae", "image")


def test_float_targets_of_a_tensor_pair_give_the_model_its_outputs():
    one = TensorPairSource(torch.randn(20, 5), torch.randn(20))
    assert one.input_kind == "signal1d" and one.shape == {"length": 5, "num_classes": 1}
    assert one.batch(3, torch.Generator().manual_seed(0))[1].shape == (3, 1)  # (N,) served as (N, 1): no broadcasting
    three = TensorPairSource(torch.randn(20, 1, 6, 6), torch.rand(20, 3))
    assert three.input_kind == "image" and three.shape == {"in_channels": 1, "image_size": 6, "num_classes": 3}


def test_batch_problem_checks_the_targets_the_loss_takes():
    shape = {"length": 4, "num_classes": 2}
    inputs = torch.randn(2, 4)
    assert batch_problem("signal1d", shape, inputs, torch.rand(2, 2), 2, "mse") is None
    assert "float targets need the spec's loss (mse" in batch_problem("signal1d", shape, inputs, torch.rand(2, 2), 2)
    assert "loss 'mse' takes float targets" in batch_problem("signal1d", shape, inputs, torch.tensor([0, 1]), 2, "mse")
    assert "where its shape {'length': 4, 'num_classes': 2} means [2, 2] (loss 'l1'" in batch_problem(
        "signal1d", shape, inputs, torch.rand(2, 3), 2, "l1")  # fmt: skip
    assert "takes targets in [0, 1]" in batch_problem("signal1d", shape, inputs, torch.tensor([[0.0, 2.0], [1.0, 0.0]]), 2, "bce_with_logits")
    assert "not all finite" in batch_problem("signal1d", shape, inputs, torch.tensor([[0.0, float("nan")], [1.0, 0.0]]), 2, "mse")
    assert batch_problem("signal1d", shape, inputs, torch.tensor([[3], [1]]), 2, f"{FIXTURE}:huber_loss") is None  # a user loss's own
    assert "token data, which loss 'mse' does not take" in batch_problem(
        "tokens", {"vocab_size": 9, "seq_len": 3}, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 2, "mse")  # fmt: skip


# --- the check at submission --------------------------------------------------------------------------


def _check(dataset: dict, loss: str | None, model: str = "mlp1d") -> dict:
    return check({"model": model, "dataset": dataset, "loss": loss, "allowed_model_modules": ALLOWED})


def test_a_regression_dataset_passes_with_a_regression_loss_and_is_refused_without_one():
    for loss in ("mse", "l1", f"{FIXTURE}:huber_loss"):
        report = _check(REGRESSION, loss)
        assert report["errors"] == [] and report["model"]["output_shape"] == [2, 1], loss
    errors = _check(REGRESSION, None)["errors"]
    assert errors[0]["loc"] == ["dataset", "name"] and "float targets need the spec's loss" in errors[0]["message"]
    assert _check(MULTI_LABEL, "bce_with_logits")["errors"] == []
    assert "takes targets in [0, 1]" in _check(REGRESSION, "bce_with_logits")["errors"][0]["message"]


def test_a_user_loss_that_sums_or_gives_one_loss_per_sample_is_refused_at_loss():
    summed = _check(REGRESSION, f"{FIXTURE}:summed_squared_error")["errors"]
    assert summed[0]["loc"] == ["loss"] and "must be the mean over the batch's samples (reduction='mean'), not their sum" in summed[0]["message"]
    per_sample = _check(REGRESSION, f"{FIXTURE}:per_sample_squared_error")["errors"]
    assert per_sample[0]["loc"] == ["loss"] and "gave a tensor of shape [2]; a loss gives the batch's mean, a scalar tensor" in per_sample[0]["message"]
    missing = _check(REGRESSION, f"{FIXTURE}:no_such_loss")["errors"]
    assert missing[0]["loc"] == ["loss"] and "has no callable 'no_such_loss'" in missing[0]["message"]


def test_a_user_loss_on_a_catalog_dataset_is_checked_too():
    report = check({"model": "mlp1d", "dataset": {"name": "mnist1d", "num_samples": 100}, "loss": f"{FIXTURE}:summed_squared_error",
                    "allowed_model_modules": ALLOWED})  # fmt: skip
    assert report["errors"][0]["loc"] == ["loss"]  # the model's (B, 10) outputs against (B,) labels: it raises, named at loss


def test_the_spec_names_the_loss_field(monkeypatch):
    monkeypatch.setenv("TULA_ALLOWED_MODEL_MODULES", FIXTURE)
    spec = JobSpec.model_validate(spec_dict(model="mlp1d", dataset=REGRESSION, loss="mse"))
    assert spec.loss == "mse" and spec.user_code_check.startswith("passed") and point_request(spec, 8)["loss"] == "mse"
    assert "is not in the catalog; did you mean mse?; known: bce_with_logits, cross_entropy, l1, mse" in _errors(spec_dict(loss="rmse"))[("loss",)]
    on_digits = _errors(spec_dict(loss="mse"))[("loss",)]  # spec_dict's dataset: a catalog one, class labels
    assert "takes float targets of the model output's shape; catalog dataset" in on_digits and "gives class labels" in on_digits
    summed = _errors(spec_dict(model="mlp1d", dataset=REGRESSION, loss=f"{FIXTURE}:summed_squared_error"))
    assert "not their sum" in summed[("loss",)]
    assert JobSpec.model_validate(spec_dict(loss="cross_entropy")).user_code_check is None  # catalog code only: nothing to run


def test_a_user_loss_outside_the_allowlist_is_refused_without_running_it(monkeypatch):
    monkeypatch.setenv("TULA_ALLOWED_MODEL_MODULES", "acme")
    assert "TULA_ALLOWED_MODEL_MODULES=tests" in _errors(spec_dict(loss=f"{FIXTURE}:huber_loss"))[("loss",)]
    assert loss_problem(f"{FIXTURE}:huber_loss", "digits") is None  # a user loss may take labels: its check decides


# --- on the worker ------------------------------------------------------------------------------------


def test_a_regression_point_measures_its_gradient_noise_under_mse():
    """A profiling point of a regression workload: timed, sized, and its gradient statistics read under the loss."""
    request = {"model": "mlp1d", "dataset": REGRESSION, "loss": "mse", "allowed_model_modules": ALLOWED, "batch_size": 32,
               "warmup_iters": 1, "timed_iters": 3, "time_cap_s": 1.0, "grad_microbatches": 4, "grad_iters": 4, "device": "cpu", "seed": 0}  # fmt: skip
    assert build_workload(request).loss_fn is mean_squared_error
    point = profile_point(request)
    assert point["status"] == "ok", point.get("error")
    gradient = point["gradient"]
    assert point["iter_time"]["median_s"] > 0 and gradient["true_grad_sq_norm"] > 0 and gradient["trace_sigma"] > 0
    assert gradient["noise_scale"] == pytest.approx(gradient["trace_sigma"] / gradient["true_grad_sq_norm"])
    with pytest.raises(ValueError, match="catalog dataset 'mnist1d' gives class labels"):
        build_workload({**request, "dataset": {"name": "mnist1d", "num_samples": 100}})


def test_a_worker_trains_with_the_users_own_loss_and_refuses_one_outside_the_allowlist():
    from tests.user_models_fixture import huber_loss

    request = {"model": "mlp1d", "dataset": REGRESSION, "loss": f"{FIXTURE}:huber_loss", "allowed_model_modules": ALLOWED,
               "batch_size": 16, "warmup_iters": 1, "timed_iters": 2, "time_cap_s": 0.5, "grad_microbatches": 2, "grad_iters": 2,
               "device": "cpu", "seed": 0}  # fmt: skip
    assert build_workload(request).loss_fn is huber_loss
    assert profile_point(request)["status"] == "ok"
    with pytest.raises(PermissionError, match="user loss module 'tests.user_models_fixture' is not allowlisted"):
        build_workload({**request, "dataset": {"name": "diabetes"}, "allowed_model_modules": ["acme"]})  # a catalog dataset: only the loss is user code


# --- a catalog regression dataset -------------------------------------------------------------------------


def test_the_diabetes_data_are_standardized_regression_targets_trained_with_mse_by_default():
    spec = JobSpec.model_validate(spec_dict(model="mlp1d", model_options={}, dataset={"name": "diabetes", "num_samples": None}))
    assert spec.dataset.num_samples == 353 and spec.dataset.split == "train" and spec.loss is None
    workload = build_workload({"model": "mlp1d", "dataset": {"name": "diabetes"}, "seed": 0})
    assert workload.loss_fn is mean_squared_error and workload.data.shape == {"length": 10, "num_classes": 1}
    inputs, targets = workload.data.inputs, workload.data.targets
    assert inputs.shape == (353, 10) and targets.shape == (353, 1)
    assert torch.allclose(inputs.mean(dim=0), torch.zeros(10), atol=1e-5) and float(targets.std()) == pytest.approx(1.0, rel=1e-5)
    assert JobSpec.model_validate(spec_dict(model="mlp1d", model_options={}, dataset={"name": "diabetes", "num_samples": None,
                                                                                      "split": "all"})).dataset.num_samples == 442
    refused = _errors(spec_dict(model="mlp1d", model_options={}, dataset={"name": "diabetes", "num_samples": None}, loss="cross_entropy"))
    assert "takes class labels; catalog dataset 'diabetes' gives float targets (a regression): use mse, l1" in refused[("loss",)]
    multi_label = _errors(spec_dict(model="mlp1d", model_options={}, dataset={"name": "diabetes", "num_samples": None}, loss="bce_with_logits"))
    assert "takes targets in [0, 1] (multi-label)" in multi_label[("loss",)]
