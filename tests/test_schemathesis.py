"""Schemathesis against the live OpenAPI schema of a real server (API only: `--executor none`, so
generated job submissions are stored and never profiled).

The schemathesis CLI runs in a subprocess (independent of its pytest plugin). Its config file binds
path job ids to real jobs (a finished one with measurements, a queued one; DELETE gets its own
throwaway jobs) and body fields to catalog names, so the generated requests reach the what-if
planner and the spec validators instead of stopping at 404 and "unknown model". Checks: all of
schemathesis's (no 5xx on any input, responses, headers and bodies as documented, schema-invalid
requests rejected, schema-valid ones accepted, Allow headers, ...), with no exception. Every schema-valid
what-if is planned (200) or does not fit the stored job (409); every schema-valid `state` filter is one of
the job states. POST /v1/jobs publishes a request schema that states the catalogs and the rules between
fields (tula_service.spec.submission_schema), and the hooks of tests.schemathesis_hooks make generated specs
meet the few rules JSON Schema cannot state (SCHEMA_CANNOT_STATE), so every generated spec must be
accepted (202).
Run it by hand: docs/api.md.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.registry import DATASETS, MODELS
from tests.handmade import measurement, spec_dict
from tula_service.catalogs import load_gpus
from tula_service.dispatch.jobs import finish_job
from tula_service.runs.replan import initial_config
from tula_service.spec.job_spec import JobSpec
from tula_service.store import run_store
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.job_store import Store

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
REPO = Path(__file__).resolve().parents[1]
CHECKS = "all"
MAX_EXAMPLES = 150  # per operation and phase: the two runs of the first test take about 100 s on 2 busy cores
# One worker: with two, hypothesis's lambda-source parsing races in CPython's ast module ("AST constructor
# recursion depth mismatch") and schemathesis reports runtime errors that are not the API's.
SEED = 20240611


def stored_jobs(database_url: str) -> dict[str, list[str]]:
    """Jobs in the database before the server starts: one done (hand-made measurements, planned),
    one queued (nothing runs them under --executor none), and two for DELETE to remove."""
    store = Store(make_session_factory(make_engine(database_url)))
    spec = spec_dict(
        batch_sizes=[8, 16, 32, 64],
        cluster={"nodes": 2, "gpus_per_node": 4, "gpu_type": "h100_sxm", "device_memory_gib": None,
                 "interconnect_gbps": None},
        pricing={"kind": "gpu_hour", "price": None},
        profiling={"search_max_batch": False, "measure_comm": False},
    )  # fmt: skip
    done, _ = store.create_job(JobSpec.model_validate(spec))
    while (point := store.claim_next_point()) is not None:
        store.finish_point(point.id, "done", measurement(point.batch_size), None, 0.1)
    finish_job(store, store.get_job(done.id))
    assert store.get_job(done.id).state == "done"
    queued = store.create_job(JobSpec.model_validate(spec_dict()))[0]
    deletable = [store.create_job(JobSpec.model_validate(spec_dict(name=f"delete-me-{i}")))[0] for i in range(2)]
    run, _ = run_store.create_run(store, done.id, {"hysteresis": 0.05, "min_steps_between_changes": 0},
                                  initial_config(store.get_job(done.id).recommendation), None)  # fmt: skip
    run_store.add_telemetry(store, run.id, [{"step": s, "samples": 256 * s, "grad_sqr": 1.0, "trace_sigma": 300.0, "step_time_s": 0.1}
                                            for s in range(1, 21)])  # fmt: skip
    return {"jobs": [done.id, queued.id], "deletable": [job.id for job in deletable], "runs": [run.id]}


def config_toml(jobs: dict[str, list[str]]) -> str:
    """schemathesis.toml: dictionaries of real names and ids, bound to where the API takes them."""
    dictionaries = {
        **jobs,
        "gpus": sorted(load_gpus()),
        "models": sorted(MODELS),
        "datasets": sorted(DATASETS),
        "kinds": ["gpu_hour", "node_hour", "memory_gb_hour"],
    }
    lines = [f"[dictionaries.{name}]\nvalues = {json.dumps(values)}\n" for name, values in dictionaries.items()]
    lines.append(
        "[parameters]\n"
        '"body.model" = { dictionary = "models", probability = 0.7 }\n'
        '"body.dataset.name" = { dictionary = "datasets", probability = 0.7 }\n'
        '"body.cluster.gpu_type" = { dictionary = "gpus", probability = 0.5 }\n'
        '"body.pricing.kind" = { dictionary = "kinds", probability = 0.5 }\n'
        '"body.job_id" = { dictionary = "jobs", probability = 0.8 }\n'
        '"path.run_id" = { dictionary = "runs", probability = 0.8 }\n'
    )
    for methods, dictionary in (('"DELETE"', "deletable"), ('["GET", "POST"]', "jobs")):
        lines.append(
            f"[[operations]]\ninclude-method = {methods}\n"
            f'parameters = {{ "path.job_id" = {{ dictionary = "{dictionary}", probability = 0.8 }} }}\n'
        )
    return "\n".join(lines)


def run_schemathesis(url: str, config: Path, checks: str, *selection: str) -> tuple[int, str]:
    command = [
        str(SCHEMATHESIS), "--config-file", str(config), "run", f"{url}/openapi.json", *selection,
        "--checks", checks, "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1",
        "--phases", "examples,coverage,fuzzing,stateful", "--request-timeout", "20",
        "--generation-database", "none", "--no-color",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # a guard against a hang, not a speed check: the run takes 2-4 min on CI and over 5 on a slow shared machine
    result = subprocess.run(command, cwd=config.parent, env=env, capture_output=True, text=True, timeout=900)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture
def api_server(make_server, tmp_path):
    """An API-only server on a database with stored jobs, and the schemathesis config naming them."""
    database_url = f"sqlite:///{tmp_path / 'tula.db'}"
    jobs = stored_jobs(database_url)
    server = make_server("--executor", "none", database_url=database_url)
    config = tmp_path / "schemathesis.toml"
    config.write_text(config_toml(jobs))
    return server, config


def check_api(server, config: Path, checks: str) -> None:
    """Everything but DELETE first (so no generated DELETE removes the stored jobs mid-run), then DELETE
    alone on its throwaway jobs; each run must exit 0, and generated what-ifs must have reached the planner."""
    for selection in (("--exclude-method", "DELETE"), ("--include-method", "DELETE")):
        started = time.monotonic()
        returncode, output = run_schemathesis(server.url, config, checks, *selection)
        server_log = server.log_path.read_text() if server.log_path.exists() else ""
        assert returncode == 0, (
            f"schemathesis {' '.join(selection)} exited with {returncode} after {time.monotonic() - started:.0f} s:\n"
            f"{output}\n--- server log (tail) ---\n{server_log[-6000:]}"
        )
        assert re.search(r"\d+ generated, \d+ passed", output), output
    replanned = re.findall(r'"POST /v1/jobs/\w+/plan HTTP/1.1" 200', server.log_path.read_text())
    assert replanned, "no generated what-if reached the planner: the job ids or the done job are missing"


def test_generated_requests_get_no_server_error_and_conforming_responses(api_server):
    check_api(*api_server, CHECKS)
