"""Bounds on a job spec (tula_service.spec.spec_limits): every one is a 422 naming its field."""

import httpx
import pydantic
import pytest

from tests.handmade import spec_dict
from tula_service.spec.job_spec import JobSpec
from tula_service.spec.spec_limits import MAX_BATCH, MAX_NUM_SAMPLES


def _errors(spec: dict) -> dict[tuple, str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        JobSpec.model_validate(spec)
    return {error["loc"]: error["msg"] for error in caught.value.errors()}


def test_more_batch_sizes_than_the_limit_are_refused_and_the_message_says_how_to_raise_it():
    message = _errors(spec_dict(batch_sizes=list(range(1, 66))))[("batch_sizes",)]
    assert "65 batch sizes: a job profiles at most 64" in message and "TULA_MAX_BATCH_SIZES" in message


def test_the_operator_moves_the_batch_size_limit(monkeypatch):
    monkeypatch.setenv("TULA_MAX_BATCH_SIZES", "3")
    assert "at most 3" in _errors(spec_dict(batch_sizes=[8, 16, 32, 64]))[("batch_sizes",)]
    assert JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32])).batch_sizes == [8, 16, 32]


def test_a_batch_above_the_largest_profiled_is_refused_in_a_list_and_in_a_range():
    assert ("batch_sizes", 1) in _errors(spec_dict(batch_sizes=[8, MAX_BATCH + 1]))
    assert "above the largest batch" in _errors(spec_dict(batch_sizes={"min": 8, "max": 2**40}))[("batch_sizes",)]


def test_a_batch_larger_than_the_dataset_is_refused():
    errors = _errors(spec_dict(dataset={"name": "synthetic_images", "num_samples": 100}, batch_sizes=[8, 128]))
    assert errors[("batch_sizes",)] == "batch 128 is larger than the dataset (100 samples per epoch)"


def test_a_reference_batch_larger_than_the_dataset_is_refused_at_its_field():
    errors = _errors(spec_dict(training={"reference_batch": 10**6, "reference_epochs": 10}))
    assert "reference batch 1000000 is larger than the dataset (50000" in errors[("training", "reference_batch")]


def test_booleans_are_not_batch_sizes_or_device_counts():
    assert "not a boolean" in _errors(spec_dict(batch_sizes=[True, 8, 16]))[("batch_sizes", 0)]
    assert "not a boolean" in _errors(spec_dict(cluster={"nodes": True}))[("cluster", "nodes")]
    assert "must be integers" in _errors(spec_dict(batch_sizes={"min": True, "max": 16}))[("batch_sizes",)]


def test_more_devices_than_the_limit_are_refused(monkeypatch):
    message = _errors(spec_dict(cluster={"nodes": 10**9, "gpus_per_node": 1}))[("cluster",)]
    assert "1000000000 devices: more than the 65536" in message and "TULA_MAX_DEVICES" in message
    monkeypatch.setenv("TULA_MAX_DEVICES", "8")
    assert "more than the 8" in _errors(spec_dict(cluster={"nodes": 2, "gpus_per_node": 8}))[("cluster",)]


def test_num_samples_is_bounded():
    assert ("dataset", "num_samples") in _errors(spec_dict(dataset={"name": "synthetic_images", "num_samples": MAX_NUM_SAMPLES + 1}))


def test_model_options_of_the_wrong_type_are_refused_at_submit():
    errors = _errors(spec_dict(model="gpt", dataset={"name": "synthetic_tokens", "num_samples": 1000},
                               model_options={"layers": "<script>"}))  # fmt: skip
    assert errors[("model_options",)] == "model option 'layers' of 'gpt' must be of type int (got '<script>')"


def test_model_options_out_of_range_or_inconsistent_are_refused():
    tokens = {"name": "synthetic_tokens", "num_samples": 1000}
    assert "between 1 and" in _errors(spec_dict(model="gpt", dataset=tokens, model_options={"layers": 0}))[("model_options",)]
    message = _errors(spec_dict(model="gpt", dataset=tokens, model_options={"width": 100, "heads": 3}))[("model_options",)]
    assert message == "model 'gpt': width (100) must be a multiple of heads (3)"
    assert JobSpec.model_validate(spec_dict(model="gpt", dataset=tokens, model_options={"width": 96.0, "heads": 3}))


def test_dropout_is_a_probability_below_one():
    signals = {"name": "mnist1d", "num_samples": 1000}
    for bad in (1.0, -0.1, True, "0.1"):
        message = _errors(spec_dict(model="mlp1d", dataset=signals, model_options={"dropout": bad}))[("model_options",)]
        assert "'dropout' of 'mlp1d'" in message
    spec = JobSpec.model_validate(spec_dict(model="mlp1d", dataset=signals, model_options={"dropout": 0}))
    assert spec.model_options == {"dropout": 0}
    assert JobSpec.model_validate(spec_dict(model="gpt", dataset={"name": "synthetic_tokens", "num_samples": 1000},
                                            model_options={"dropout": 0.1}))  # fmt: skip


def test_the_api_answers_a_bound_with_a_422_naming_the_field(live_server):
    spec = spec_dict(batch_sizes=list(range(1, 200)))
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec, timeout=30)
    assert response.status_code == 422
    assert [e["field"] for e in response.json()["errors"]] == ["body.batch_sizes"]


def test_a_boolean_is_no_number_anywhere_in_a_spec_or_a_what_if():
    """pydantic's lax float reads JSON `true` as 1.0; every float field refuses it, naming the field."""
    from tula_service.plan.whatif import WhatIf

    for section, field in (("training", "reference_lr"), ("pricing", "price"), ("cluster", "device_memory_gib")):
        spec = spec_dict()
        spec[section][field] = True
        with pytest.raises(pydantic.ValidationError, match=f"{field}: give a number, not a boolean"):
            JobSpec.model_validate(spec)
    spec = spec_dict()
    spec["training"]["reference_run"] = {"gradient_stats": [{"samples": 64, "batch": 32, "grad_sqr": 1.0, "trace_sigma": True}]}
    with pytest.raises(pydantic.ValidationError, match="give a number, not a boolean"):
        JobSpec.model_validate(spec)
    with pytest.raises(pydantic.ValidationError, match="price: give a number, not a boolean"):
        WhatIf.model_validate({"pricing": {"price": True}})
    assert WhatIf.model_validate({"pricing": {"price": 3}}).given() == {"pricing": {"price": 3.0}}


def test_gradient_statistics_past_1e100_are_refused_at_their_field():
    """Pooling thousands of records near float's limit overflowed to inf and the answer's JSON to a 500: such a
    value is no measurement, so it is a 422 naming it (reference-run records and telemetry alike)."""
    from tula_service.runs.telemetry import TelemetryRecord
    from tula_service.spec.spec_limits import MAX_GRADIENT_STATISTIC

    record = {"samples": 1000, "batch": 32, "grad_sqr": 1.0, "trace_sigma": 1e307}
    errors = _errors(spec_dict(training={"reference_run": {"gradient_stats": [record]}}))
    assert "less than or equal to" in errors[("training", "reference_run", "gradient_stats", 0, "trace_sigma")]
    negative = {**record, "trace_sigma": 10.0, "precond_grad_sqr": -1e200}
    assert ("training", "reference_run", "gradient_stats", 0, "precond_grad_sqr") in _errors(
        spec_dict(training={"optimizer": "adam", "reference_run": {"gradient_stats": [negative]}}))
    JobSpec.model_validate(spec_dict(training={"reference_run": {"gradient_stats": [{**record, "trace_sigma": MAX_GRADIENT_STATISTIC}]}}))
    with pytest.raises(pydantic.ValidationError, match="grad_sqr"):
        TelemetryRecord.model_validate({"step": 1, "grad_sqr": 2e100})
