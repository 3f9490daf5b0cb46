"""TulaRun in a real training loop (torch on CPU) against a real server: telemetry every window, advice
fetched in the background, a dead and restarted server survived by buffering, and the offline JSONL
uploaded later, once."""

import json
import time

import httpx
import pytest

torch = pytest.importorskip("torch")

from profiler.tula_run import TulaRun, upload  # noqa: E402
from tests.api_fixtures import run_on_a_server  # noqa: E402

STEPS, EVERY, ACCUMULATION, MICRO_BATCH = 60, 10, 2, 16


@pytest.fixture
def run_on_server(make_server, tmp_path):
    return run_on_a_server(make_server, tmp_path)


def _train(run: TulaRun, steps: int, first_step: int = 0, seed: int = 0) -> list[dict]:
    """A linear classifier on random data, ACCUMULATION micro-batches a step; the records TulaRun made."""
    torch.manual_seed(seed)
    model, records = run.model, []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(ACCUMULATION):
            x = torch.randn(MICRO_BATCH, 8)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()) / ACCUMULATION
            loss.backward()
        record = run.step(loss=loss.item() * ACCUMULATION)
        optimizer.step()
        if record:
            records.append(record)
    return records


def _tula_run(server_url, run_id, **options) -> TulaRun:
    model = torch.nn.Linear(8, 2)
    run = TulaRun(server_url, run_id, model, every=EVERY, accumulation=ACCUMULATION, **options)
    run.model = model
    return run


def _run_view(server, run_id) -> dict:
    return httpx.get(f"{server.url}/v1/runs/{run_id}", timeout=10).json()


def test_a_training_loop_sends_its_telemetry_and_gets_advice(run_on_server):
    server, run_id = run_on_server
    run = _tula_run(server.url, run_id, plan_every_s=0.5)
    records = _train(run, STEPS)
    deadline = time.monotonic() + 60
    while run.advice is None and time.monotonic() < deadline:
        time.sleep(0.1)
    run.close()
    assert [r["step"] for r in records] == list(range(EVERY, STEPS + 1, EVERY))
    first = records[0]
    assert first["device_batch"] == MICRO_BATCH and first["accumulation"] == ACCUMULATION and first["samples"] == EVERY * 2 * MICRO_BATCH
    assert first["step_time_s"] > 0 and first["trace_sigma"] is not None and first["grad_sqr"] is not None
    view = _run_view(server, run_id)
    assert view["records"] == STEPS // EVERY and view["last_step"] == STEPS and run.sent == STEPS // EVERY
    assert run.advice["run_id"] == run_id and "config" in run.advice and run.dropped == 0


def test_a_dead_server_costs_the_loop_nothing_and_gets_everything_when_it_is_back(run_on_server):
    server, run_id = run_on_server
    server.stop()
    run = _tula_run(server.url, run_id, timeout_s=0.5, plan_every_s=3600)
    _train(run, 30)
    deadline = time.monotonic() + 10  # the sender posts every post_every_s (1 s)
    while run.failed_posts == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.buffered == 3 and run.failed_posts >= 1  # trained on; the records wait
    server.start()  # the same port and database: the server restarted
    _train(run, 30, seed=1)
    run.close(flush_timeout_s=60)
    assert run.buffered == 0 and run.sent == 6
    view = _run_view(server, run_id)
    assert view["records"] == 6 and view["last_step"] == 60


def test_offline_records_upload_later_and_once(run_on_server, tmp_path):
    server, run_id = run_on_server
    path = tmp_path / "telemetry.jsonl"
    run = _tula_run(None, run_id, offline_path=path)
    _train(run, 45)
    run.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [10, 20, 30, 40, 45]  # the last, partial window too
    assert upload(path, server.url, run_id) == {"accepted": 5, "duplicates": 0}
    assert upload(path, server.url, run_id) == {"accepted": 0, "duplicates": 5}
    assert _run_view(server, run_id)["last_step"] == 45
    with pytest.raises(ValueError, match="offline_path"):
        TulaRun(None, run_id, torch.nn.Linear(2, 2), accumulation=2)


def test_records_say_how_most_steps_ran_when_the_loop_splits_only_the_sampled_ones(tmp_path):
    """sample_every=5: statistics on 2 steps in 5, split in ACCUMULATION micro-batches; the other 3 run whole
    (one pass of the batch), so the records report one pass of ACCUMULATION x MICRO_BATCH: the step the run trains
    with. The global batch, and so samples, does not change."""
    path = tmp_path / "telemetry.jsonl"
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = TulaRun(None, "run-1", model, optimizer, every=EVERY, accumulation=ACCUMULATION, offline_path=path, sample_every=5)
    torch.manual_seed(0)
    for _ in range(30):
        optimizer.zero_grad()
        x = torch.randn(ACCUMULATION * MICRO_BATCH, 8)
        y = (x[:, 0] > 0).long()
        pieces = ACCUMULATION if run.sampling else 1
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            (torch.nn.functional.cross_entropy(model(xs), ys) / pieces).backward()
        with torch.no_grad():
            model(x)  # an evaluation pass between steps is not a training pass
        run.step()
        optimizer.step()
    run.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert all(r["accumulation"] == 1 and r["device_batch"] == ACCUMULATION * MICRO_BATCH and r["step_time_s"] > 0 for r in records)
    assert all(r["samples"] == r["step"] * ACCUMULATION * MICRO_BATCH and "grad_sqr" in r for r in records)


def test_records_of_a_loop_that_always_accumulates_say_so(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    run = _tula_run(None, "run-1", offline_path=path)
    _train(run, 20)
    run.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["accumulation"] == ACCUMULATION and r["device_batch"] == MICRO_BATCH for r in records)
