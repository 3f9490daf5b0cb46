import math

import pydantic
import pytest

from tests.handmade import spec_dict
from tula_service.plan.advice import variability_at_batch
from tula_service.spec.job_spec import OPTIMIZER_NAMES, OPTIMIZER_SETTING_DEFAULTS, GradientStatsRecord, JobSpec, optimizer_setting_names
from tula_service.spec.spec_limits import MAX_GRADIENT_STATISTIC


def _errors(spec: dict) -> dict[tuple, str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        JobSpec.model_validate(spec)
    return {error["loc"]: error["msg"] for error in caught.value.errors()}


def test_example_spec_is_valid_and_batches_are_sorted_unique():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[64, 8, 8, 32]))
    assert spec.batch_sizes == [8, 32, 64]


def test_batch_range_expands_to_powers_of_two_and_its_ends():
    spec = JobSpec.model_validate(spec_dict(batch_sizes={"min": 6, "max": 100}))
    assert spec.batch_sizes == [6, 8, 16, 32, 64, 100]


def test_zero_batch_names_the_list_position():
    assert ("batch_sizes", 1) in _errors(spec_dict(batch_sizes=[8, 0]))


def test_reversed_batch_range_is_rejected():
    assert "must be <= max" in _errors(spec_dict(batch_sizes={"min": 64, "max": 8}))[("batch_sizes",)]


def test_single_batch_size_is_not_enough_to_fit_a_line():
    assert "at least 2" in _errors(spec_dict(batch_sizes=[32, 32]))[("batch_sizes",)]


def test_negative_price_names_the_field():
    assert ("pricing", "price") in _errors(spec_dict(pricing={"price": -1}))


def test_unknown_model_lists_the_known_ones():
    message = _errors(spec_dict(model="resnet5"))[("model",)]
    assert "'resnet5' is not in the catalog" in message and "resnet18" in message and "small_cnn" in message


def test_unknown_dataset_lists_the_known_ones():
    message = _errors(spec_dict(dataset={"name": "imagenet"}))[("dataset", "name")]
    assert "synthetic_images" in message


def test_unknown_field_is_rejected_not_ignored():
    assert ("objectiv",) in _errors({**spec_dict(), "objectiv": "knee"})


def test_unknown_objective_and_pricing_kind():
    errors = _errors(spec_dict(objective="fastest", pricing={"kind": "spot"}))
    assert ("objective",) in errors and ("pricing", "kind") in errors


def test_values_given_in_the_spec_are_recorded_as_given():
    spec = JobSpec.model_validate(spec_dict(cluster={"intra_node_link": "nvlink3"}))
    assert (spec.cluster.device_memory_source, spec.cluster.intra_node_link_source, spec.pricing.price_source) == (
        "spec", "spec", "spec",
    )
    assert JobSpec.model_validate(spec_dict()).cluster.intra_node_link_source is None  # no named link, no source


def test_missing_device_memory_without_a_gpu_type_names_the_field():
    spec = spec_dict()
    del spec["cluster"]["device_memory_gib"]
    assert "gpu_type" in _errors(spec)[("cluster", "device_memory_gib")]


def test_max_lr_needs_a_reference_lr_at_or_below_it():
    assert "needs reference_lr" in _errors(spec_dict(training={"max_lr": 0.4}))[("training",)]
    assert "below reference_lr" in _errors(spec_dict(training={"reference_lr": 0.1, "max_lr": 0.05}))[("training",)]
    assert JobSpec.model_validate(spec_dict(training={"reference_lr": 0.1, "max_lr": 0.4})).training.max_lr == 0.4


def test_momentum_is_sgds_and_rmsprops_and_a_fraction_below_one():
    assert JobSpec.model_validate(spec_dict(training={"momentum": 0})).training.sgd_momentum() == {"value": 0.0, "source": "spec"}
    assert JobSpec.model_validate(spec_dict()).training.sgd_momentum() == {"value": 0.9, "source": "assumed"}
    assert JobSpec.model_validate(spec_dict(training={"optimizer": "adam"})).training.sgd_momentum() is None
    assert "momentum" not in JobSpec.model_validate(spec_dict(training={"optimizer": "adam"})).training.optimizer_settings()
    assert "momentum is SGD's and RMSprop's; optimizer adamw has none" in _errors(spec_dict(training={"optimizer": "adamw", "momentum": 0.9}))[("training", "momentum")]
    rmsprop = JobSpec.model_validate(spec_dict(training={"optimizer": "rmsprop", "momentum": 0.9})).training
    assert rmsprop.optimizer_settings()["momentum"] == {"value": 0.9, "source": "spec"} and rmsprop.sgd_momentum() is None
    assert JobSpec.model_validate(spec_dict(training={"optimizer": "rmsprop"})).training.optimizer_settings()["momentum"] == {"value": 0.0, "source": "assumed"}
    assert ("training", "optimizer") in _errors(spec_dict(training={"optimizer": "adadelta"}))


def test_every_optimizer_setting_is_its_optimizers_with_its_default_assumed():
    """Each setting of OPTIMIZER_SETTING_DEFAULTS is taken with the optimizers that have it, reported with its source,
    and refused, naming the field and what the optimizer takes, with the others."""
    for name, defaults in OPTIMIZER_SETTING_DEFAULTS.items():
        for optimizer in OPTIMIZER_NAMES:
            given = {"betas": [0.8, 0.9], "nesterov": True, "centered": True, "amsgrad": True, "decoupled_weight_decay": True}.get(name, 0.25)
            training = spec_dict(training={"optimizer": optimizer, name: given})
            if optimizer not in defaults:
                message = _errors(training)[("training", name)]
                assert f"optimizer {optimizer} has none" in message and ", ".join(optimizer_setting_names(optimizer)) in message
                continue
            settings = JobSpec.model_validate(training).training.optimizer_settings()
            assert settings[name] == {"value": given, "source": "spec"}, (name, optimizer)
            default = JobSpec.model_validate(spec_dict(training={"optimizer": optimizer})).training.optimizer_settings()[name]
            assert default == {"value": list(defaults[optimizer]) if name == "betas" else defaults[optimizer], "source": "assumed"}
    assert set(JobSpec.model_validate(spec_dict(training={"optimizer": "rmsprop"})).training.optimizer_settings()) == {
        "momentum", "eps", "alpha", "centered", "weight_decay"}  # fmt: skip
    assert JobSpec.model_validate(spec_dict(training={"optimizer": "adamw"})).training.optimizer_settings()["weight_decay"]["value"] == 0.01
    assert set(JobSpec.model_validate(spec_dict(training={"optimizer": "nadam"})).training.optimizer_settings()) == {
        "betas", "eps", "momentum_decay", "decoupled_weight_decay", "weight_decay"}  # fmt: skip
    assert set(JobSpec.model_validate(spec_dict(training={"optimizer": "radam"})).training.optimizer_settings()) == {
        "betas", "eps", "decoupled_weight_decay", "weight_decay"}  # fmt: skip
    assert set(JobSpec.model_validate(spec_dict(training={"optimizer": "adamax"})).training.optimizer_settings()) == {"betas", "eps", "weight_decay"}
    adagrad = JobSpec.model_validate(spec_dict(training={"optimizer": "adagrad"})).training.optimizer_settings()
    assert adagrad == {"eps": {"value": 1e-10, "source": "assumed"}, "weight_decay": {"value": 0.0, "source": "assumed"}}  # PyTorch's
    assert "optimizer adagrad has none" in _errors(spec_dict(training={"optimizer": "adagrad", "betas": [0.9, 0.99]}))[("training", "betas")]
    adafactor = JobSpec.model_validate(spec_dict(training={"optimizer": "adafactor"})).training.optimizer_settings()
    assert adafactor == {"weight_decay": {"value": 0.0, "source": "assumed"}}  # PyTorch's; its eps pair, beta2_decay and d are not the spec's
    assert "optimizer adafactor has none" in _errors(spec_dict(training={"optimizer": "adafactor", "eps": 1e-8}))[("training", "eps")]
    assert set(JobSpec.model_validate(spec_dict()).training.optimizer_settings()) == {"momentum", "nesterov", "dampening", "weight_decay"}
    assert "momentum_decay is NAdam's; optimizer radam has none" in _errors(spec_dict(training={"optimizer": "radam", "momentum_decay": 0.004}))[("training", "momentum_decay")]
    assert "decoupled_weight_decay is NAdam's and RAdam's; optimizer adam has none" in _errors(
        spec_dict(training={"optimizer": "adam", "decoupled_weight_decay": True}))[("training", "decoupled_weight_decay")]


def test_optimizer_settings_are_checked_as_torch_would():
    assert "needs momentum > 0" in _errors(spec_dict(training={"nesterov": True, "momentum": 0}))[("training", "nesterov")]
    assert "needs dampening 0" in _errors(spec_dict(training={"nesterov": True, "dampening": 0.1}))[("training", "dampening")]
    assert JobSpec.model_validate(spec_dict(training={"nesterov": True, "dampening": 0})).training.optimizer_settings()["dampening"]["value"] == 0
    assert JobSpec.model_validate(spec_dict(training={"nesterov": True})).training.optimizer_settings()["momentum"]["value"] == 0.9
    for name, bad in (("weight_decay", -0.1), ("weight_decay", float("inf")), ("eps", 0.0), ("alpha", 1.0), ("nesterov", "yes"), ("nesterov", 1),
                      ("momentum_decay", -0.001), ("momentum_decay", float("nan")), ("decoupled_weight_decay", "true"),
                      ("dampening", 1.5), ("dampening", -0.1)):
        optimizer = {"eps": "adam", "alpha": "rmsprop", "momentum_decay": "nadam", "decoupled_weight_decay": "radam"}.get(name, "sgd")
        assert ("training", name) in _errors(spec_dict(training={"optimizer": optimizer, name: bad})), (name, bad)
    assert "weight_decay" in str(_errors(spec_dict(training={"weight_decay": True})))  # a boolean is not a number


def test_betas_are_adams_and_adamws_each_in_zero_one():
    adamw = JobSpec.model_validate(spec_dict(training={"optimizer": "adamw", "betas": [0.9, 0.95]})).training
    assert adamw.optimizer_settings()["betas"] == {"value": [0.9, 0.95], "source": "spec"} and "momentum" not in adamw.optimizer_settings()
    assert JobSpec.model_validate(spec_dict(training={"optimizer": "adam"})).training.optimizer_settings()["betas"] == {"value": [0.9, 0.999], "source": "assumed"}
    assert "betas" not in JobSpec.model_validate(spec_dict()).training.optimizer_settings()  # SGD
    assert "betas is Adam's, AdamW's, NAdam's, RAdam's and Adamax's" in _errors(spec_dict(training={"betas": [0.9, 0.95]}))[("training", "betas")]
    assert "betas is Adam's, AdamW's, NAdam's, RAdam's and Adamax's" in _errors(spec_dict(training={"optimizer": "rmsprop", "betas": [0.9, 0.95]}))[("training", "betas")]
    for bad in ([0.9, 1.0], [-0.1, 0.9], [0.9, float("nan")]):
        assert any(key[:2] == ("training", "betas") for key in _errors(spec_dict(training={"optimizer": "adam", "betas": bad}))), bad
    assert any(key[:2] == ("training", "betas") for key in _errors(spec_dict(training={"optimizer": "adam", "betas": [0.9]})))
    assert "not a boolean" in str(_errors(spec_dict(training={"optimizer": "adam", "betas": [False, 0.9]})))
    for bad in (1.0, -0.1):
        assert ("training", "momentum") in _errors(spec_dict(training={"momentum": bad}))
    assert "momentum: give a number" in _errors(spec_dict(training={"momentum": True}))[("training",)]


def test_step_placements_are_multi_device_placements_that_fit_the_cluster():
    cluster = {"nodes": 2, "gpus_per_node": 4}
    spec = JobSpec.model_validate(spec_dict(cluster=cluster, profiling={"step_placements": [[2, 2], [4], [2, 2]]}))
    assert spec.profiling.step_placements == [[2, 2], [4]]  # distinct, in order
    too_big = _errors(spec_dict(cluster=cluster, profiling={"step_placements": [[4], [1, 1, 1]]}))
    assert list(too_big) == [("profiling", "step_placements", 0)] and "does not fit the cluster's 2 nodes of 4 GPUs" in too_big[("profiling", "step_placements", 0)]
    one_device = _errors(spec_dict(cluster=cluster, profiling={"step_placements": [[1]]}))
    assert "2 or more devices" in next(iter(one_device.values()))


def test_a_records_variability_is_bounded_so_the_ags_delta_scaled_from_it_stays_finite():
    """Schemathesis sent variability 1.8e308 at batch 73 to a plan at batch 1: the delta scaled to it,
    v sqrt((b + B_noise) / (B + B_noise)), overflowed to infinity, which the response schema cannot carry."""
    record = {"samples": 73, "batch": 73, "grad_sqr": 1.0, "trace_sigma": 1.0}
    with pytest.raises(pydantic.ValidationError, match="variability"):
        GradientStatsRecord.model_validate({**record, "variability": 1.7976931348623155e308})
    largest = GradientStatsRecord.model_validate({**record, "variability": MAX_GRADIENT_STATISTIC}).variability
    assert all(math.isfinite(v) for v in variability_at_batch([(largest, 73)], 1, 1e-300))


def test_every_optimizer_of_the_spec_is_known_wherever_optimizers_are_listed():
    """A new training.optimizer touches several lists (an optimizer added to one and not another would fail only where
    it is used): the torch class profiling builds, the statistic the service reads, the LR rule's square-root set (the
    preconditioned ones), the dashboard's form and its torch.optim line."""
    import re
    from pathlib import Path

    from profiler.measure import OPTIMIZER_CLASSES
    from tula_service.fit.efficiency_evidence import STATISTIC_FOR_OPTIMIZER
    from tula_service.fit.perfmodel.efficiency import OPTIMIZERS_WITH_SQRT_LR

    root = Path(__file__).resolve().parents[1] / "tula_service"
    assert {name: cls.__name__ for name, cls in OPTIMIZER_CLASSES.items()} == OPTIMIZER_NAMES
    assert set(STATISTIC_FOR_OPTIMIZER) == set(OPTIMIZER_NAMES)
    assert set(OPTIMIZERS_WITH_SQRT_LR) == {name for name, statistic in STATISTIC_FOR_OPTIMIZER.items() if statistic == "preconditioned"}
    form = (root / "templates" / "new_job.html").read_text()
    select = form[form.index('<select name="optimizer">'):]
    assert re.findall(r'<option value="(\w+)">(\w+)</option>', select[: select.index("</select>")]) == list(OPTIMIZER_NAMES.items())
    line = re.search(r"const TORCH_OPTIMIZERS = \{(.*?)\};", (root / "static" / "js" / "recommendation.js").read_text()).group(1)
    assert dict(re.findall(r'(\w+): "(\w+)"', line)) == OPTIMIZER_NAMES
