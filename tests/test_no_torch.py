"""The server side must import, validate, plan and serve without torch installed."""

import subprocess
import sys
import textwrap

from tests.conftest import REPO

BLOCK_TORCH = textwrap.dedent(
    """
    import sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith(("torch.", "torchvision")):
                raise ImportError(f"torch is blocked in this test (tried to import {name})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_blocker_really_blocks_torch():
    result = _run("import torch")
    assert result.returncode != 0 and "torch is blocked" in result.stderr


def test_server_app_imports_serves_and_plans_without_torch(tmp_path):
    result = _run(
        f"""
        from fastapi.testclient import TestClient
        from tula_service.api import Settings, create_app
        from tula_service.cli import build_parser
        from tula_service.plan.recommend import plan
        from tula_service.spec.job_spec import JobSpec
        from tests.handmade import measurement, spec_dict

        app = create_app(Settings(database_url="sqlite:///{tmp_path}/t.db"))
        with TestClient(app) as client:
            assert client.get("/healthz").status_code == 200
            assert client.post("/v1/jobs", json={{"model": "nope"}}).status_code == 422
        rec = plan(JobSpec.model_validate(spec_dict()), [measurement(b) for b in (8, 16, 32)])
        assert rec["chosen"]["total_time_s"]["value"] > 0
        import sys
        assert not any(name == "torch" or name.startswith("torch.") for name in sys.modules)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
