"""`tula submit` checks the spec itself before sending it, and leaves the server's policy to the server: the
allowlist of user code, the data roots and the bounds are the server's environment (JobSpec.checked_by_client).
A CLI on a laptop refused user code the server allowed, since it read the allowlist from its own environment."""

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.conftest import REPO
from tests.handmade import spec_dict
from tula_service.spec.job_spec import JobSpec

USER_MODEL = "tests.user_models_fixture:tiny_classifier"
ALLOWLIST, DEVICES, BATCH_SIZES = "TULA_ALLOWED_MODEL_MODULES", "TULA_MAX_DEVICES", "TULA_MAX_BATCH_SIZES"
POLICY = (ALLOWLIST, DEVICES, BATCH_SIZES, "TULA_DATA_ROOTS")


def submit(spec: dict, server_url: str, tmp_path, **client_env: str) -> subprocess.CompletedProcess:
    """`tula submit SPEC.yaml` as a user runs it, with the server's policy variables absent from its environment
    except those given."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {key: value for key, value in os.environ.items() if key not in POLICY} | client_env
    return subprocess.run([sys.executable, "-m", "tula_service", "submit", str(path), "--server", server_url],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip


def job_spec(server_url: str, stdout: str) -> dict:
    job_id = stdout.split("submitted job ")[1].split()[0]
    return httpx.get(f"{server_url}/v1/jobs/{job_id}", timeout=30).json()["spec"]


def test_user_code_the_server_allows_is_sent_and_checked_there(make_server, tmp_path):
    server = make_server("--executor", "none", env={ALLOWLIST: "tests.user_models_fixture"})
    result = submit(spec_dict(model=USER_MODEL), server.url, tmp_path)  # the CLI's environment allows nothing
    assert result.returncode == 0, result.stderr
    assert job_spec(server.url, result.stdout)["user_code_check"].startswith("passed")


def test_user_code_the_server_refuses_is_the_servers_error_naming_the_field(make_server, tmp_path):
    server = make_server("--executor", "none")
    result = submit(spec_dict(model=USER_MODEL), server.url, tmp_path, **{ALLOWLIST: "tests"})
    assert result.returncode != 0
    assert "model" in result.stderr and f"{ALLOWLIST}=tests.user_models_fixture" in result.stderr


def test_the_servers_bounds_are_its_own_not_the_clients(make_server, tmp_path):
    spec = spec_dict(batch_sizes=[8, 16, 32], cluster={"nodes": 2, "gpus_per_node": 4})
    server = make_server("--executor", "none")
    accepted = submit(spec, server.url, tmp_path, **{DEVICES: "4", BATCH_SIZES: "2"})  # a stricter client
    assert accepted.returncode == 0, accepted.stderr
    strict = make_server("--executor", "none", env={DEVICES: "4"})
    refused = submit(spec, strict.url, tmp_path)
    assert refused.returncode != 0 and "cluster" in refused.stderr and "more than the 4 this server plans for" in refused.stderr


def test_a_path_under_the_servers_data_root_is_the_servers_to_judge(make_server, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    server = make_server("--executor", "none", "--data-root", str(root))
    spec = spec_dict(model="gpt", dataset={"name": "token_file", "path": str(root / "corpus.bin"), "num_samples": 1000})
    result = submit(spec, server.url, tmp_path)  # no data root in the CLI's environment
    assert result.returncode == 0, result.stderr


def test_a_mistake_in_the_spec_itself_is_still_named_before_anything_is_sent(tmp_path):
    spec = spec_dict(model=USER_MODEL, batch_sizes=[8], pricing={"price": -1})
    result = submit(spec, "http://127.0.0.1:9", tmp_path)  # nothing listens there: the check comes first
    assert result.returncode != 0
    assert "batch_sizes" in result.stderr and "pricing.price" in result.stderr and "cannot reach" not in result.stderr


def test_client_side_validation_skips_only_the_servers_policy(monkeypatch):
    for name in POLICY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(DEVICES, "4")
    spec = spec_dict(model=USER_MODEL, cluster={"nodes": 2, "gpus_per_node": 4})
    checked = JobSpec.checked_by_client(spec)
    assert checked.user_code_check is None  # not imported here: the server checks it
    with pytest.raises(ValueError, match="not allowlisted"):
        JobSpec.model_validate(spec)
    with pytest.raises(ValueError, match="more than the 4 this server plans for"):
        JobSpec.model_validate({**spec, "model": "small_cnn"})
    with pytest.raises(ValueError, match="larger than the dataset"):
        JobSpec.checked_by_client(spec_dict(model=USER_MODEL, dataset={"num_samples": 16}, batch_sizes=[8, 32]))
