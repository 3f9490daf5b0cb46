"""What exists (catalog endpoints and CLI) and user models behind the allowlist, on a real server."""

import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import REPO
from tests.handmade import spec_dict
from tula_service.client import TulaClient
from tula_service.spec.job_spec import JobSpec

USER_MODEL = "tests.user_models_fixture:tiny_classifier"
USER_DATASET = {"name": "tests.user_models_fixture:blob_images", "num_samples": 512}
ALLOWLISTED = {"TULA_ALLOWED_MODEL_MODULES": "tests.user_models_fixture"}
FAST = {"time_cap_s": 0.2, "grad_iters": 2, "timed_iters": 2, "warmup_iters": 1}


def test_catalog_lists_models_and_datasets_with_their_fields(live_server):
    models = httpx.get(f"{live_server.url}/v1/catalog/models").json()
    names = {m["name"]: m for m in models["models"]}
    assert {"small_cnn", "resnet18", "resnet50", "vgg11", "gpt", "cnn1d"} <= set(names)
    assert names["gpt"]["input_kind"] == "tokens" and names["gpt"]["options"]["layers"] == 2
    datasets = {d["name"]: d for d in httpx.get(f"{live_server.url}/v1/catalog/datasets").json()["datasets"]}
    assert {"synthetic_images", "synthetic_tokens", "digits", "mnist1d", "image_folder", "token_file"} <= set(datasets)
    assert datasets["image_folder"]["required"] == ["path"] and datasets["digits"]["fixed_num_samples"] == 1437
    assert datasets["digits"]["fields"] == {"image_size": 8, "scaling": "unit", "split": "train"}
    assert datasets["mnist1d"]["max_num_samples"] == 200_000


def test_cli_lists_the_catalog(live_server):
    result = subprocess.run(
        [sys.executable, "-m", "tula_service", "catalog", "datasets", "--server", live_server.url],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and "mnist1d" in result.stdout and "token_file" in result.stdout


def test_dataset_field_that_does_not_apply_is_refused_naming_it():
    with pytest.raises(ValueError, match="field 'seq_len' does not apply to dataset 'synthetic_images'"):
        JobSpec.model_validate(spec_dict(dataset={"seq_len": 64}))


def test_model_and_dataset_of_different_kinds_are_refused():
    with pytest.raises(ValueError, match="model 'gpt' takes tokens inputs but dataset 'synthetic_images' gives image"):
        JobSpec.model_validate(spec_dict(model="gpt"))


def test_image_size_the_model_cannot_take_is_refused():
    with pytest.raises(ValueError, match="alexnet' needs image_size >= 64"):
        JobSpec.model_validate(spec_dict(model="alexnet"))


def test_user_model_outside_the_allowlist_is_422_with_the_fix(live_server):
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec_dict(model=USER_MODEL))
    assert response.status_code == 422
    assert "TULA_ALLOWED_MODEL_MODULES=tests.user_models_fixture" in response.json()["errors"][0]["message"]


@pytest.mark.e2e
def test_allowlisted_user_model_is_profiled_and_planned(make_server):
    server = make_server(env={"TULA_ALLOWED_MODEL_MODULES": "tests.user_models_fixture"})
    spec = spec_dict(model=USER_MODEL, model_options={"hidden": 16}, batch_sizes=[8, 16, 32], profiling=FAST)
    with TulaClient(server.url) as client:
        job = client.wait(client.submit(spec).id, poll_s=0.3, timeout_s=300)
        assert job.state == "done", job.error
        assert client.recommendation(job.id)["chosen"]["total_time_s"]["value"] > 0


@pytest.mark.e2e
def test_a_model_whose_gradients_overflow_is_profiled_and_planned_without_its_noise_scale(make_server):
    server = make_server(env=ALLOWLISTED)
    spec = spec_dict(model="tests.user_models_fixture:overflowing_classifier", dataset=USER_DATASET, batch_sizes=[8, 16, 32],
                     profiling=FAST)  # fmt: skip
    with TulaClient(server.url) as client:
        job = client.wait(client.submit(spec).id, poll_s=0.3, timeout_s=300)
        assert job.state == "done", job.error
        rec = client.recommendation(job.id)
    assert all(point["iter_time_median_s"] > 0 and point["noise_scale"] is None for point in rec["profiled"]["points"])
    efficiency = rec["models"]["efficiency"]
    assert efficiency["source"] == "assumed"
    assert efficiency["warnings"] == ["initialization: the gradient statistics of the points at batch 8, 16, 32 were not finite "
                                      "or past +-1e+100 (an fp16 overflow, a diverging model): left out"]  # fmt: skip


def test_digits_default_is_the_train_split_and_a_mnist1d_beyond_its_bound_is_refused():
    assert JobSpec.model_validate(spec_dict(dataset={"name": "digits", "num_samples": None})).dataset.num_samples == 1437
    spec = JobSpec.model_validate(spec_dict(dataset={"name": "digits", "num_samples": None, "split": "all"}))
    assert spec.dataset.num_samples == 1797 and spec.dataset.scaling == "unit"
    with pytest.raises(ValueError, match="dataset 'mnist1d' generates at most 200000 samples"):
        JobSpec.model_validate(spec_dict(dataset={"name": "mnist1d", "num_samples": 250_000}))


def test_user_code_that_breaks_the_contract_is_a_422_naming_the_field(make_server):
    server = make_server(env=ALLOWLISTED)
    wrong_batch = spec_dict(model=USER_MODEL, dataset={"name": "tests.user_models_fixture:wrong_batch_shape", "num_samples": 512})
    response = httpx.post(f"{server.url}/v1/jobs", json=wrong_batch, timeout=60)
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "body.dataset.name"
    assert "gave inputs of shape [2, 1, 8, 7]" in response.json()["errors"][0]["message"]
    wrong_signature = spec_dict(model="tests.user_models_fixture:needs_width", dataset=USER_DATASET)
    fields = {e["field"] for e in httpx.post(f"{server.url}/v1/jobs", json=wrong_signature, timeout=60).json()["errors"]}
    assert fields == {"body.model", "body.model_options.width"}
    accepted = httpx.post(f"{server.url}/v1/jobs", json=spec_dict(model=USER_MODEL, dataset=USER_DATASET), timeout=60)
    assert accepted.status_code == 202


def test_a_user_code_check_sent_by_the_client_is_ignored_and_the_code_is_checked(make_server):
    server = make_server(env=ALLOWLISTED)
    wrong_batch = spec_dict(model=USER_MODEL, dataset={"name": "tests.user_models_fixture:wrong_batch_shape", "num_samples": 512},
                            user_code_check="passed: trust me")  # fmt: skip
    response = httpx.post(f"{server.url}/v1/jobs", json=wrong_batch, timeout=60)
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "body.dataset.name"


def test_the_server_answers_other_requests_while_it_checks_user_code(make_server):
    server = make_server(env=ALLOWLISTED)
    sleepy = spec_dict(model=USER_MODEL, dataset={"name": "tests.user_models_fixture:sleepy_dataset", "num_samples": 512})
    result: dict = {}
    submission = threading.Thread(target=lambda: result.update(response=httpx.post(f"{server.url}/v1/jobs", json=sleepy, timeout=60)))
    submission.start()
    answered_during_check = 0
    while submission.is_alive():
        if httpx.get(f"{server.url}/healthz", timeout=60).status_code == 200 and submission.is_alive():
            answered_during_check += 1
        time.sleep(0.2)
    assert result["response"].status_code == 202 and result["response"].json()["spec"]["user_code_check"].startswith("passed")
    assert answered_during_check >= 3  # the 3 s the dataset takes to build, at least


def test_user_dataset_outside_the_allowlist_is_422_with_the_fix(live_server):
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec_dict(dataset=USER_DATASET))
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "body.dataset.name"
    assert "user dataset module 'tests.user_models_fixture' is not allowlisted" in response.json()["errors"][0]["message"]


@pytest.mark.e2e
def test_allowlisted_user_dataset_is_profiled_and_planned(make_server):
    server = make_server(env=ALLOWLISTED)
    spec = spec_dict(model="small_cnn", dataset=USER_DATASET, batch_sizes=[8, 16, 32], profiling=FAST)
    with TulaClient(server.url) as client:
        job = client.wait(client.submit(spec).id, poll_s=0.3, timeout_s=300)
        assert job.state == "done", job.error
        assert client.recommendation(job.id)["chosen"]["total_time_s"]["value"] > 0


def test_catalog_lists_the_losses_and_the_cli_prints_them(live_server):
    listing = httpx.get(f"{live_server.url}/v1/catalog/losses").json()
    assert listing["default"] == "cross_entropy" and listing["user_losses"]["env"] == "TULA_ALLOWED_MODEL_MODULES"
    assert {loss["name"]: loss["targets"] for loss in listing["losses"]} == {
        "cross_entropy": "labels", "mse": "float", "l1": "float", "bce_with_logits": "probabilities"}  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "tula_service", "catalog", "losses", "--server", live_server.url],
                            capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "cross_entropy" in result.stdout and "(default)" in result.stdout and "user losses 'module:function'" in result.stdout
    datasets = subprocess.run([sys.executable, "-m", "tula_service", "catalog", "datasets", "--server", live_server.url],
                              capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
    assert "split=train, targets=float, loss=mse" in next(line for line in datasets.stdout.splitlines() if line.startswith("diabetes"))


@pytest.mark.e2e
def test_a_regression_job_trains_its_pilot_and_profiles_under_its_loss(make_server):
    """A user's regression data (float targets) with loss mse: the points and the pilot train under it, and the noise
    scale comes from the pilot's trajectory of that loss."""
    server = make_server(env=ALLOWLISTED)
    dataset = {"name": "tests.user_models_fixture:regression_signals", "num_samples": 2048}
    spec = spec_dict(model="mlp1d", dataset=dataset, loss="mse", batch_sizes=[8, 16, 32],
                     training={"reference_batch": 16, "reference_epochs": 2.0, "reference_lr": 0.01},
                     profiling={**FAST, "pilot": True, "pilot_steps": 60, "pilot_seconds": 10, "pilot_record_every": 5})  # fmt: skip
    refused = httpx.post(f"{server.url}/v1/jobs", json={**spec, "loss": None}, timeout=60)
    assert refused.status_code == 422 and "float targets need the spec's loss" in refused.json()["errors"][0]["message"]
    with TulaClient(server.url) as client:
        job = client.wait(client.submit(spec).id, poll_s=0.3, timeout_s=300)
        assert job.state == "done", job.error
        assert job.spec["loss"] == "mse"
        rec = client.recommendation(job.id)
    noise = rec["models"]["efficiency"]["noise_scale"]
    assert noise["evidence"] == "pilot" and noise["value"] > 0
    assert all(point["iter_time_median_s"] > 0 for point in rec["profiled"]["points"])


@pytest.mark.e2e
def test_the_catalog_regression_dataset_is_profiled_and_planned_under_mse(live_server):
    spec = spec_dict(model="mlp1d", model_options={}, dataset={"name": "diabetes", "num_samples": None}, batch_sizes=[8, 16, 32],
                     profiling=FAST)  # fmt: skip
    with TulaClient(live_server.url) as client:
        job = client.wait(client.submit(spec).id, poll_s=0.3, timeout_s=300)
        assert job.state == "done", job.error
        rec = client.recommendation(job.id)
    assert rec["models"]["efficiency"]["noise_scale"]["value"] > 0  # from the points' gradients under mse (2 iterations each:
    assert all(point["iter_time_median_s"] > 0 for point in rec["profiled"]["points"])  # a point's |G|^2 may be unresolved)
