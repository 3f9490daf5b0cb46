"""`tula run ...` as a user runs it, against a real server holding a done job: a run started, its telemetry
uploaded from a file (checked line by line first, sent in posts of the server's bound, stored once), its advice
and its decisions printed."""

import json
import subprocess
import sys

import httpx
import pytest

from tests.api_fixtures import finished_job, store_for
from tests.conftest import REPO


def tula(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tula_service", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture
def server_and_job(make_server, tmp_path):
    database = tmp_path / "runs.db"
    job_id = finished_job(store_for(f"sqlite:///{database}"))
    return make_server("--executor", "none", database_path=database), job_id


def _write_records(path, first: int, last: int, global_batch: int, trace_sigma: float) -> None:
    """Steps first..last of a run whose noise scale is trace_sigma / 1.0, one JSON record a line."""
    records = [{"step": s, "samples": s * global_batch, "grad_sqr": 1.0, "trace_sigma": trace_sigma, "variability": 0.2,
                "step_time_s": 0.05, "loss": 2.0 - s * 1e-4} for s in range(first, last + 1)]  # fmt: skip
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_run_is_started_fed_from_a_file_once_and_moved_by_its_advice(server_and_job, tmp_path):
    server, job_id = server_and_job
    started = tula("run", "start", job_id, "--min-steps-between-changes", "0", "--json", "--server", server.url)
    assert started.returncode == 0, started.stderr
    run = json.loads(started.stdout)
    batch = run["config"]["global_batch"]
    recommended = httpx.get(f"{server.url}/v1/jobs/{job_id}/recommendation", timeout=10).json()["chosen"]
    assert batch == recommended["global_batch"] and run["records"] == 0
    telemetry = tmp_path / "telemetry.jsonl"
    _write_records(telemetry, 1, 2_500, batch, 5000.0)  # the noise scale 50x the profiled one: a larger batch is faster

    uploaded = tula("run", "upload", run["id"], str(telemetry), "--server", server.url)
    assert uploaded.returncode == 0, uploaded.stderr
    assert uploaded.stdout.strip() == f"run {run['id']}: 2500 records stored, 0 it held already (3 posts); it holds 2500, last step 2500"
    again = tula("run", "upload", run["id"], str(telemetry), "--json", "--server", server.url)
    assert json.loads(again.stdout) == {"accepted": 0, "duplicates": 2500, "posts": 3, "records": 2500, "last_step": 2500}

    plan = tula("run", "plan", run["id"], "--server", server.url)
    assert plan.returncode == 0, plan.stderr
    first, why, noise = plan.stdout.splitlines()
    moved_to = httpx.get(f"{server.url}/v1/runs/{run['id']}", timeout=10).json()["config"]
    assert first.startswith(f"run {run['id']} at step 2500: CHANGED, train with global batch {moved_to['global_batch']} ")
    assert moved_to["global_batch"] > batch and why.startswith(f"  why: global batch {batch} -> {moved_to['global_batch']}")
    assert noise.startswith("  noise scale ") and 4750 <= float(noise.split()[2]) <= 5250, noise
    assert "from live trajectory: the live trajectory covers " in noise  # why this evidence
    shown = tula("run", "show", run["id"], "--server", server.url)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == f"run {run['id']} of job {job_id}: 2500 telemetry records, last step 2500"
    assert f"  step 2500: global batch {batch} -> {moved_to['global_batch']}: global batch {batch} ->" in shown.stdout


def test_a_run_of_a_job_with_a_reference_lr_prints_its_labelled_lr(make_server, tmp_path):
    """The run's LR and multiplier come labelled ({"value", "source"}): start, plan and show printed a traceback."""
    database = tmp_path / "runs.db"
    job_id = finished_job(store_for(f"sqlite:///{database}"), training={"reference_lr": 0.1})
    server = make_server("--executor", "none", database_path=database)
    started = tula("run", "start", job_id, "--server", server.url)
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split()[2]
    assert started.stdout.splitlines()[1] == f"run {run_id} of job {job_id}: 0 telemetry records"  # no "last step None"
    config = httpx.get(f"{server.url}/v1/runs/{run_id}", timeout=10).json()["config"]
    lr, multiplier = config["lr"], config["lr_multiplier"]
    expected = f", LR {lr['value']:.4g} ({lr['source']}; x{multiplier['value']:.3g} the reference, {multiplier['source']})"
    assert expected in started.stdout.splitlines()[2], started.stdout
    for command in ("plan", "show"):
        shown = tula("run", command, run_id, "--server", server.url)
        assert shown.returncode == 0 and expected in shown.stdout, shown.stderr


def test_a_bad_telemetry_file_is_named_by_line_and_field_and_nothing_is_sent(server_and_job, tmp_path):
    server, job_id = server_and_job
    run_id = json.loads(tula("run", "start", job_id, "--json", "--server", server.url).stdout)["id"]
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text('{"step": 1, "samples": 32}\n\n{"step": 2, "samples": \n{"step": -3}\n{"step": 4, "grad_sqr": "x"}\n')

    result = tula("run", "upload", run_id, str(telemetry), "--server", server.url)

    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {telemetry} is not a telemetry file (one TelemetryRecord a line):",
        "  line 3: not JSON (Expecting value, column 23)",
        "  line 4: step: Input should be greater than or equal to 0",
        "  line 5: grad_sqr: Input should be a valid number, unable to parse string as a number",
    ]
    assert httpx.get(f"{server.url}/v1/runs/{run_id}", timeout=10).json()["records"] == 0
    missing = tula("run", "upload", run_id, str(tmp_path / "none.jsonl"), "--server", server.url)
    assert missing.returncode == 2 and "cannot read telemetry" in missing.stderr and "No such file" in missing.stderr
    binary = tmp_path / "weights.pt"
    binary.write_bytes(bytes(range(256)))
    not_text = tula("run", "upload", run_id, str(binary), "--server", server.url)
    assert not_text.returncode == 2 and f"{binary} is not a text file of JSON lines" in not_text.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert f"{empty} holds no telemetry records" in tula("run", "upload", run_id, str(empty), "--server", server.url).stderr


def test_unknown_runs_and_bad_options_are_clear_errors(server_and_job):
    server, job_id = server_and_job
    unknown = tula("run", "plan", "nope", "--server", server.url)
    assert unknown.returncode == 2 and unknown.stderr.strip() == "error: server answered 404: run 'nope' not found"
    not_a_job = tula("run", "start", "nope", "--server", server.url)
    assert not_a_job.returncode == 2 and "server answered 404: job 'nope' not found" in not_a_job.stderr
    options = tula("run", "start", job_id, "--hysteresis", "5", "--min-steps-between-changes", "-1", "--server", server.url)
    assert options.returncode == 2 and options.stderr.splitlines() == [
        "error: not a run the server would start:",
        "  --hysteresis: Input should be less than or equal to 1",
        "  --min-steps-between-changes: Input should be greater than or equal to 0",
    ]


def test_the_file_a_tula_run_writes_offline_is_what_the_cli_uploads(server_and_job, tmp_path):
    torch = pytest.importorskip("torch")
    from profiler.tula_run import TulaRun

    server, job_id = server_and_job
    run_id = json.loads(tula("run", "start", job_id, "--json", "--server", server.url).stdout)["id"]
    path = tmp_path / "offline.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = TulaRun(None, run_id, model, optimizer, every=10, accumulation=2, offline_path=path)
    for _ in range(35):
        optimizer.zero_grad()
        for _ in range(2):
            x = torch.randn(16, 8)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()) / 2
            loss.backward()
        run.step(loss=loss.item() * 2)
        optimizer.step()
    run.close()

    uploaded = tula("run", "upload", run_id, str(path), "--json", "--server", server.url)

    assert uploaded.returncode == 0, uploaded.stderr
    assert json.loads(uploaded.stdout) == {"accepted": 4, "duplicates": 0, "posts": 1, "records": 4, "last_step": 35}
    stored = httpx.get(f"{server.url}/v1/runs/{run_id}/telemetry", timeout=10).json()["records"]
    assert stored == [json.loads(line) for line in path.read_text().splitlines()]
