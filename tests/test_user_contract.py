"""The user code contract (docs/user_models.md): user datasets on the worker, and the submit-time check that
turns a broken model or dataset into a validation error naming the field."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from models.data import build_dataset
from models.user_contract import TensorPairSource, batch_problem, call_arguments
from models.workload import build_workload
from tests.conftest import REPO
from tests.handmade import spec_dict
from tests.test_no_torch import BLOCK_TORCH
from tula_service.spec.job_spec import JobSpec
from tula_service.spec.user_code_check import run_contract_check

FIXTURE = "tests.user_models_fixture"
ALLOWED = [FIXTURE]
TINY = f"{FIXTURE}:tiny_classifier"
BLOBS = {"name": f"{FIXTURE}:blob_images", "num_samples": 600}


@pytest.fixture
def allowlisted(monkeypatch):
    monkeypatch.setenv("TULA_ALLOWED_MODEL_MODULES", FIXTURE)


def _errors(spec: dict) -> dict[tuple, str]:
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(spec)
    return {error["loc"]: error["msg"] for error in caught.value.errors()}


# --- the contract on the worker (torch side) ---------------------------------------------------------


def test_dataset_factory_gets_num_samples_and_seed_only_when_it_names_them():
    def named(*, num_samples, image_size):
        return None

    arguments, problems = call_arguments(named, {"image_size": 8}, {"num_samples": 100, "seed": 3})
    assert arguments == {"image_size": 8, "num_samples": 100} and problems == []
    _, problems = call_arguments(named, {"image_size": 8, "path": "/data"}, {})
    assert [argument for argument, _ in problems] == ["path", "num_samples"]


def test_a_tensor_pair_is_wrapped_with_its_kind_and_shape_read_from_the_tensors():
    signals = TensorPairSource(torch.randn(30, 12), torch.arange(30) % 4)
    assert signals.input_kind == "signal1d" and signals.shape == {"length": 12, "num_classes": 4}
    tokens = TensorPairSource(torch.arange(40).reshape(4, 10), torch.arange(1, 41).reshape(4, 10))
    assert tokens.input_kind == "tokens" and tokens.shape == {"vocab_size": 41, "seq_len": 10}
    images = TensorPairSource(torch.randn(5, 3, 6, 6), torch.zeros(5, dtype=torch.long))
    inputs, targets = images.batch(7, torch.Generator().manual_seed(0))
    assert images.shape == {"in_channels": 3, "image_size": 6, "num_classes": 1} and inputs.shape == (7, 3, 6, 6)


def test_batch_problem_says_what_shape_the_dataset_promised():
    shape = {"in_channels": 1, "image_size": 8, "num_classes": 3}
    assert batch_problem("image", shape, torch.randn(2, 1, 8, 8), torch.tensor([0, 2]), 2) is None
    assert "shape [2, 1, 8, 7]" in batch_problem("image", shape, torch.randn(2, 1, 8, 7), torch.tensor([0, 2]), 2)
    assert "outside [0, num_classes = 3)" in batch_problem("image", shape, torch.randn(2, 1, 8, 8), torch.tensor([0, 3]), 2)
    assert "int64" in batch_problem("image", shape, torch.randn(2, 1, 8, 8), torch.tensor([0.0, 1.0]), 2)


def test_worker_builds_a_catalog_model_for_a_user_dataset():
    request = {"model": "small_cnn", "dataset": BLOBS, "allowed_model_modules": ALLOWED}
    workload = build_workload(request)
    inputs, targets = workload.data.batch(4, torch.Generator().manual_seed(0))
    assert workload.input_kind == "image" and workload.model(inputs).shape == (4, 3)


def test_worker_builds_a_user_model_on_user_tokens():
    request = {"model": "gpt", "model_options": {"layers": 1, "width": 32, "heads": 2},
               "dataset": {"name": f"{FIXTURE}:token_pairs", "num_samples": 50}, "allowed_model_modules": ALLOWED}
    workload = build_workload(request)
    inputs, targets = workload.data.batch(3, torch.Generator().manual_seed(0))
    assert workload.tokens_per_sample == 16 and workload.model(inputs).shape == (3, 16, 50)


def test_worker_refuses_a_catalog_model_of_another_kind_on_a_user_dataset():
    request = {"model": "small_cnn", "dataset": {"name": f"{FIXTURE}:signal_pairs", "num_samples": 40}, "allowed_model_modules": ALLOWED}
    with pytest.raises(ValueError, match="model 'small_cnn' takes image inputs but dataset '.*signal_pairs' gives signal1d"):
        build_workload(request)


def test_worker_imports_no_user_dataset_outside_the_allowlist():
    with pytest.raises(PermissionError, match="TULA_ALLOWED_MODEL_MODULES=tests.user_models_fixture"):
        build_dataset(f"{FIXTURE}:blob_images", num_samples=10, allowed_modules=["acme"])


# --- the check at submission (JobSpec validation) -------------------------------------------------------


def test_good_user_model_and_dataset_pass_and_the_spec_records_the_check(allowlisted):
    spec = JobSpec.model_validate(spec_dict(model=TINY, model_options={"hidden": 4}, dataset=BLOBS))
    assert spec.user_code_check.startswith("passed: built on 2 samples; dataset gives image")
    assert "model output [2, 3]" in spec.user_code_check


def test_dataset_whose_batch_has_the_wrong_shape_is_refused_at_dataset_name(allowlisted):
    errors = _errors(spec_dict(model=TINY, dataset={"name": f"{FIXTURE}:wrong_batch_shape", "num_samples": 512}))
    assert "gave inputs of shape [2, 1, 8, 7]" in errors[("dataset", "name")]


def test_model_factory_with_a_wrong_signature_is_refused_naming_model_and_option(allowlisted):
    errors = _errors(spec_dict(model=f"{FIXTURE}:needs_width", dataset=BLOBS))
    assert "must take the image dataset's shape as keyword arguments in_channels, image_size, num_classes" in errors[("model",)]
    assert "needs 'width' (no default)" in errors[("model_options", "width")]


def test_model_with_the_wrong_output_shape_is_refused(allowlisted):
    errors = _errors(spec_dict(model=f"{FIXTURE}:one_logit_too_many", dataset=BLOBS))
    assert "gave [2, 4]; on image data a model gives (batch, num_classes) = [2, 3]" in errors[("model",)]


def test_dataset_options_reach_the_factory_and_a_missing_one_is_named(allowlisted):
    needs_radius = {"name": f"{FIXTURE}:needs_radius", "num_samples": 512}
    errors = _errors(spec_dict(model=TINY, dataset=needs_radius))
    assert "needs 'radius'" in errors[("dataset", "options", "radius")]
    spec = JobSpec.model_validate(spec_dict(model=TINY, dataset={**needs_radius, "options": {"radius": 2.0}}))
    assert spec.user_code_check.startswith("passed")


def test_user_dataset_outside_the_allowlist_is_refused_without_running_it(monkeypatch):
    monkeypatch.setenv("TULA_ALLOWED_MODEL_MODULES", "acme")
    errors = _errors(spec_dict(dataset={"name": f"{FIXTURE}:slow_dataset", "num_samples": 512}))
    assert "TULA_ALLOWED_MODEL_MODULES=tests.user_models_fixture" in errors[("dataset", "name")]


def test_user_dataset_needs_num_samples(allowlisted):
    errors = _errors(spec_dict(dataset={"name": f"{FIXTURE}:blob_images", "num_samples": None}))
    assert "needs 'num_samples'" in errors[("dataset", "num_samples")]


def test_catalog_specs_are_not_checked():
    assert JobSpec.model_validate(spec_dict()).user_code_check is None


def test_a_spec_that_was_checked_is_not_checked_again(allowlisted):
    stored = spec_dict(model=f"{FIXTURE}:one_logit_too_many", dataset=BLOBS, user_code_check="passed: at submission")
    assert JobSpec.model_validate(stored).user_code_check == "passed: at submission"


def test_a_check_that_runs_too_long_is_skipped_with_a_note():
    request = {"model": TINY, "dataset": {"name": f"{FIXTURE}:slow_dataset", "num_samples": 10}, "allowed_model_modules": ALLOWED}
    result = run_contract_check(request, timeout_s=3)
    assert result.problems == [] and result.note.startswith("skipped: the check did not finish within 3 s")


def test_without_torch_the_check_is_skipped_and_the_spec_says_so():
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        import os
        os.environ["TULA_ALLOWED_MODEL_MODULES"] = "{FIXTURE}"
        from tula_service.spec.job_spec import JobSpec
        from tests.handmade import spec_dict
        spec = JobSpec.model_validate(spec_dict(model="{TINY}", dataset={BLOBS!r}))
        print(spec.user_code_check)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("skipped: torch is not importable by this server's Python")


def test_a_worker_refuses_a_user_dataset_batch_of_the_wrong_shape_with_the_check_message():
    request = {"model": "small_cnn", "dataset": {"name": f"{FIXTURE}:wrong_batch_shape", "num_samples": 10}, "allowed_model_modules": ALLOWED}
    with pytest.raises(ValueError, match=r"batch\(2, generator\) gave inputs of shape \[2, 1, 8, 7\]"):
        build_workload(request)


def test_the_check_runs_as_a_command_and_prints_its_report():
    request = {"model": "mlp1d", "dataset": {"name": f"{FIXTURE}:signal_pairs", "num_samples": 30}, "allowed_model_modules": ALLOWED}
    result = subprocess.run([sys.executable, "-m", "models.user_contract", "--check", json.dumps(request)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    report = json.loads(result.stdout)
    assert report["errors"] == [] and report["dataset"] == {"input_kind": "signal1d", "shape": {"length": 12, "num_classes": 2}}
    assert report["model"]["output_shape"] == [2, 2]
