"""The `tula` CLI as a user runs it, against a real server."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port

EXAMPLE = REPO / "configs" / "example_small_cnn.yaml"


def tula(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tula_service", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.e2e
def test_submit_wait_prints_progress_and_the_recommendation_then_show_repeats_it(live_server):
    result = tula("submit", str(EXAMPLE), "--wait", "--poll-s", "0.5", "--server", live_server.url)
    assert result.returncode == 0, result.stderr
    assert "6/6 points  done" in result.stdout
    assert "chosen: global batch" in result.stdout and "predicted total time" in result.stdout
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    shown = tula("show", job_id, "--server", live_server.url)
    assert shown.returncode == 0 and "chosen: global batch" in shown.stdout


def test_invalid_spec_file_is_a_clear_error_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("price: 2.5", "price: -3").replace("model: small_cnn", "model: resnet5"))
    result = tula("submit", str(bad), "--server", "http://127.0.0.1:9")
    assert result.returncode != 0
    assert "pricing.price" in result.stderr and "'resnet5' is not in the catalog" in result.stderr


def test_missing_spec_file_is_a_clear_error(tmp_path):
    result = tula("submit", str(tmp_path / "nope.yaml"))
    assert result.returncode != 0 and "cannot read spec" in result.stderr


def test_unreachable_server_is_a_clear_error():
    result = tula("show", "abc", "--server", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2 and "cannot reach the Tula server" in result.stderr
