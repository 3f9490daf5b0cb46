"""The published request schema of POST /v1/jobs (tula_service.spec.submission_schema) against the validators:
what the schema allows, JobSpec accepts, and what the schema can state that JobSpec refuses, the schema
refuses too. schemathesis runs the same agreement on generated specs (tests/test_schemathesis.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import jsonschema
import pytest
import referencing.jsonschema
import yaml
from pydantic import ValidationError
from referencing import Registry, Resource

from models.data_roots import DATA_ROOTS_ENV
from models.registry import ALLOWED_MODULES_ENV, DATASETS, MODELS
from tests.handmade import spec_dict
from tests.schemathesis_hooks import meeting_the_rules
from tula_service.api import Settings, create_app
from tula_service.spec.job_spec import OPTIMIZER_SETTING_DEFAULTS, JobSpec
from tula_service.spec.submission_schema import COMPONENT, SCHEMA_CANNOT_STATE

REPO = Path(__file__).resolve().parents[1]
SUBMIT_BODY = ("paths", "/v1/jobs", "post", "requestBody", "content", "application/json", "schema")


def published_document(tmp_path: Path) -> dict:
    """A real app's OpenAPI document (with the environment as it is set now)."""
    return create_app(Settings(database_url=f"sqlite:///{tmp_path / 'tula.db'}", executor="none")).openapi()


def submission_validator(document: dict) -> jsonschema.Draft202012Validator:
    """A validator of the schema POST /v1/jobs names as its body."""
    body = document
    for key in SUBMIT_BODY:
        body = body[key]
    assert body == {"$ref": f"#/components/schemas/{COMPONENT}"}
    resource = Resource.from_contents(document, default_specification=referencing.jsonschema.DRAFT202012)
    registry = Registry().with_resource("urn:openapi", resource)
    return jsonschema.Draft202012Validator({"$ref": f"urn:openapi#/components/schemas/{COMPONENT}"}, registry=registry)


@pytest.fixture
def document(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ROOTS_ENV, raising=False)
    monkeypatch.delenv(ALLOWED_MODULES_ENV, raising=False)
    return published_document(tmp_path)


@pytest.fixture
def schema(document):
    return submission_validator(document)


@pytest.fixture
def api(make_server):
    server = make_server("--executor", "none")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def accepted(spec: dict) -> bool:
    try:
        JobSpec.model_validate(spec)
    except ValidationError:
        return False
    return True


def test_the_example_configs_meet_the_schema(schema):
    for path in sorted((REPO / "configs").glob("example_*")):
        spec = yaml.safe_load(path.read_text())
        assert list(schema.iter_errors(spec)) == [], path.name


def test_the_schema_lists_the_rules_it_cannot_state(document):
    description = document["components"]["schemas"][COMPONENT]["description"]
    for rule in SCHEMA_CANNOT_STATE:
        assert rule in description


@pytest.mark.parametrize(
    ("why", "change"),
    [
        ("an unknown model", {"model": "resnet9000"}),
        ("a model that does not take the dataset's inputs", {"model": "gpt"}),
        ("a field the dataset does not take", {"dataset": {"seq_len": 32}}),
        ("an unknown dataset", {"dataset": {"name": "imagenet"}}),
        ("options for a catalog dataset", {"dataset": {"options": {"a": 1}}}),
        ("an option the model does not take", {"model_options": {"layers": 2}}),
        ("one batch size", {"batch_sizes": [16]}),
        ("no price and no GPU with a catalog price", {"pricing": {"kind": "node_hour", "price": None}}),
        ("objective deadline without deadline_h", {"objective": "deadline"}),
        ("momentum for adam", {"training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": "adam", "momentum": 0.9}}),
        ("betas for sgd", {"training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": "sgd", "betas": [0.9, 0.95]}}),
        ("betas without an optimizer (sgd's default)", {"training": {"reference_batch": 64, "reference_epochs": 10, "betas": [0.9, 0.95]}}),
        ("eps for sgd", {"training": {"reference_batch": 64, "reference_epochs": 10, "eps": 1e-6}}),
        ("centered for adam", {"training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": "adam", "centered": True}}),
        ("nesterov for rmsprop", {"training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": "rmsprop", "nesterov": True}}),
        ("a negative weight decay", {"training": {"reference_batch": 64, "reference_epochs": 10, "weight_decay": -0.1}}),
        ("nesterov as a string", {"training": {"reference_batch": 64, "reference_epochs": 10, "nesterov": "yes"}}),
        ("neither device memory nor a gpu_type", {"cluster": {"device_memory_gib": None}}),
        ("an unknown GPU", {"cluster": {"gpu_type": "tpu_v5", "device_memory_gib": 16}}),
        ("an unknown interconnect", {"cluster": {"intra_node_link": "carrier_pigeon"}}),
        ("an unknown loss", {"loss": "rmse"}),
        ("a user loss without an allowlist", {"loss": "acme.losses:focal"}),
    ],
)
def test_a_spec_the_validators_refuse_for_a_rule_the_schema_states_is_schema_invalid(schema, why, change):
    spec = spec_dict()
    assert accepted(spec) and schema.is_valid(spec), "the base spec must be valid in both"
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict) and key != "training":
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    assert not accepted(spec), why
    assert not schema.is_valid(spec), why


def test_every_optimizer_setting_with_its_optimizer_is_valid_in_both(schema):
    given = {"betas": [0.9, 0.95], "nesterov": True, "centered": True, "amsgrad": True, "decoupled_weight_decay": True, "momentum": 0.5}
    for name, defaults in OPTIMIZER_SETTING_DEFAULTS.items():
        for optimizer in defaults:
            spec = {**spec_dict(), "training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": optimizer, name: given.get(name, 0.1)}}
            assert accepted(spec) and schema.is_valid(spec), (name, optimizer)
    spec = {**spec_dict(), "training": {"reference_batch": 64, "reference_epochs": 10, "nesterov": True, "weight_decay": 5e-4}}
    assert accepted(spec) and schema.is_valid(spec)  # sgd by default, its momentum 0.9 by default


def test_momentum_for_sgd_and_rmsprop_and_betas_for_adam_and_adamw_are_valid_in_both(schema):
    for optimizer in ("sgd", "rmsprop"):
        spec = {**spec_dict(), "training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": optimizer, "momentum": 0.9}}
        assert accepted(spec) and schema.is_valid(spec), optimizer
    for optimizer in ("adam", "adamw", "nadam", "radam", "adamax"):
        spec = {**spec_dict(), "training": {"reference_batch": 64, "reference_epochs": 10, "optimizer": optimizer, "betas": [0.9, 0.95]}}
        assert accepted(spec) and schema.is_valid(spec), optimizer


def minimal_spec(model: str, dataset: str) -> dict:
    spec = spec_dict(model=model, dataset={"name": dataset, "num_samples": 5000}, model_options={})
    spec["dataset"] = {"name": dataset, "num_samples": 5000}
    return spec


def test_schema_and_validators_agree_on_every_catalog_model_and_dataset(schema):
    """Each (model, dataset) pair of the catalogs, made to meet the rules the schema cannot state: the
    schema allows it exactly when JobSpec accepts it (file datasets are off without data roots)."""
    disagreements = []
    for model in MODELS:
        for dataset in DATASETS:
            spec = minimal_spec(model, dataset)
            try:
                spec = meeting_the_rules(copy.deepcopy(spec))
            except (KeyError, TypeError):
                pass
            if schema.is_valid(spec) != accepted(spec):
                disagreements.append((model, dataset, schema.is_valid(spec)))
    assert disagreements == []


def test_with_a_data_root_a_file_dataset_under_it_is_schema_valid_and_one_outside_is_not(tmp_path, monkeypatch):
    root = tmp_path / "data"
    monkeypatch.setenv(DATA_ROOTS_ENV, str(root))
    monkeypatch.delenv(ALLOWED_MODULES_ENV, raising=False)
    schema = submission_validator(published_document(tmp_path))
    inside = f"{root}/images/train"
    for path, valid in ((inside, True), ("/etc", False), (f"{root}/../etc", False), (f"{root}x/images", False),
                        ("images/train", False)):  # fmt: skip
        spec = spec_dict(dataset={"name": "image_folder", "path": path, "num_samples": 1000})
        assert schema.is_valid(spec) is valid, path
        assert accepted(spec) is valid, path


def test_an_allowlisted_user_model_matches_the_schema_and_another_module_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ROOTS_ENV, raising=False)
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "acme.models")
    schema = submission_validator(published_document(tmp_path))
    allowed = spec_dict(model="acme.models.vision:build", model_options={})
    assert schema.is_valid(allowed)
    for ref in ("acme_evil:build", "other.models:build", "acme.models"):
        assert not schema.is_valid(spec_dict(model=ref, model_options={})), ref


def test_max_lr_without_reference_lr_is_refused_and_the_schema_says_it_cannot_state_it(schema):
    """max_lr's need of reference_lr is listed rather than stated (stated beside nine optimizers' settings, the schema
    was one that schemathesis could no longer generate from); the repair gives it a reference_lr at max_lr."""
    spec = spec_dict(training={"reference_batch": 64, "reference_epochs": 10, "max_lr": 0.5})
    assert schema.is_valid(spec) and not accepted(spec)
    repaired = meeting_the_rules(copy.deepcopy(spec))
    assert repaired["training"]["reference_lr"] == 0.5 and accepted(repaired)
    assert any("max_lr only with training.reference_lr" in rule for rule in SCHEMA_CANNOT_STATE)


def test_nesterov_without_momentum_or_with_dampening_is_refused_and_the_schema_says_it_cannot_state_it(schema):
    """Nesterov's rule is listed rather than stated (stated beside eight optimizers' settings, the schema was one that
    schemathesis could no longer generate from); the repair turns Nesterov off, the least change torch takes."""
    base = {"reference_batch": 64, "reference_epochs": 10}
    assert accepted(spec_dict(training={**base, "nesterov": True})) and accepted(spec_dict(training={**base, "nesterov": True, "momentum": 0.5}))
    for change in ({"momentum": 0}, {"dampening": 0.5}):
        spec = spec_dict(training={**base, "nesterov": True, **change})
        assert schema.is_valid(spec) and not accepted(spec), change
        assert meeting_the_rules(copy.deepcopy(spec))["training"]["nesterov"] is False and accepted(meeting_the_rules(spec)), change
    assert not schema.is_valid(spec_dict(training={**base, "optimizer": "rmsprop", "nesterov": True}))  # SGD's alone: stated


def test_initial_weights_outside_the_data_roots_are_refused_and_the_schema_says_it_cannot_state_it(schema, monkeypatch):
    """initial_weights' rule (a path under a data root) is listed rather than stated (any constraint on it made the
    schema one that schemathesis could no longer generate from); the repair leaves the weights out."""
    for weights in ("/data/pretrained.pt", 3):
        spec = spec_dict(initial_weights=weights)
        assert schema.is_valid(spec) and not accepted(spec), weights  # no data root on this server
        repaired = meeting_the_rules(copy.deepcopy(spec))
        assert repaired["initial_weights"] is None and accepted(repaired), weights
    monkeypatch.setenv(DATA_ROOTS_ENV, "/data")
    assert accepted(spec_dict(initial_weights="/data/pretrained.pt"))
    assert meeting_the_rules(spec_dict(initial_weights="/data/pretrained.pt"))["initial_weights"] == "/data/pretrained.pt"
    assert any(rule.startswith("initial_weights: null, or a string path under") for rule in SCHEMA_CANNOT_STATE)


def test_a_loss_the_dataset_does_not_take_is_refused_and_the_schema_says_it_cannot_state_it(schema):
    """Which loss fits which dataset is a rule the schema lists rather than states (stated as alternatives, the schema
    was one that schemathesis could no longer generate from); the regression dataset takes mse and l1."""
    regression = {"model": "mlp1d", "model_options": {}, "dataset": {"name": "diabetes", "num_samples": None}}
    for loss in (None, "mse", "l1"):
        spec = spec_dict(**regression, loss=loss)
        assert accepted(spec) and schema.is_valid(spec), loss
    for spec in (spec_dict(**regression, loss="cross_entropy"), spec_dict(loss="mse"), spec_dict(loss="bce_with_logits")):
        assert schema.is_valid(spec) and not accepted(spec) and meeting_the_rules(copy.deepcopy(spec))["loss"] is None
        assert accepted(meeting_the_rules(spec))


def test_an_allowlisted_loss_matches_the_schema_and_another_module_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ROOTS_ENV, raising=False)
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "acme")
    schema = submission_validator(published_document(tmp_path))
    for loss, valid in (("acme.losses:focal", True), ("mse", True), ("cross_entropy", True), (None, True), ("other.losses:focal", False),
                        ("rmse", False)):  # fmt: skip
        assert schema.is_valid(spec_dict(loss=loss)) is valid, loss


def test_server_set_sources_in_a_submission_are_ignored_not_refused(api):
    """`*_source` fields are the server's: a client's are dropped, and the server derives them again."""
    spec = spec_dict()
    spec["cluster"] = {**spec["cluster"], "device_memory_source": "catalog-assumed", "gpu_type": None}
    spec["pricing"] = {**spec["pricing"], "price_source": "catalog-assumed", "kind": "node_hour"}
    response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 202, response.text
    stored = response.json()["spec"]
    assert stored["cluster"]["device_memory_source"] == "spec"
    assert stored["pricing"]["price_source"] == "spec"
    spec["pricing"]["price_source"] = "made-up"
    refused = api.post("/v1/jobs", json=spec)
    assert refused.status_code == 422 and "price_source" in refused.text


def _inlined(node, components: dict):
    """A schema with every #/components/schemas/... reference replaced by its target (the document's are acyclic)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inlined(components[node["$ref"].rsplit("/", 1)[-1]], components)
        return {key: _inlined(value, components) for key, value in node.items()}
    if isinstance(node, list):
        return [_inlined(value, components) for value in node]
    return node


def test_the_submission_schema_stays_simple_enough_for_schemathesis_to_generate_from(document):
    """Schemathesis generates requests from a canonical form (jsonschema_rs.canonicalize) and refuses the operation when
    the form stays raw: an allOf of an anyOf per optimizer setting did at ten settings (three operations untested, the
    schemathesis test failed). The settings' rule is one anyOf of a branch per optimizer now; this fails in a second
    where the schemathesis test fails in minutes."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    submission = _inlined(document["components"]["schemas"][COMPONENT], document["components"]["schemas"])
    canonical = jsonschema_rs.canonicalize(submission, draft=jsonschema_rs.Draft202012)
    from jsonschema_rs import canonical as canonical_forms

    assert canonical.kind is not canonical_forms.CanonicalKind.RAW, canonical.kind
