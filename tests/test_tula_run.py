"""TulaRun in a real training loop (torch on CPU) against a real server: telemetry every window, advice
fetched in the background, a dead and restarted server survived by buffering, and the offline JSONL
uploaded later, once."""

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")


from profiler.tula_run import COST_PER_CALL_SECOND, TulaRun, upload  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.gloo_ranks import gloo_group, spawn_ranks  # noqa: E402
from benchmarks.live_server import plan_answers  # noqa: E402
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
    # every step sampled: the statistics sit at the mean of the samples seen after each step of the window
    assert first["statistics_samples"] == round(ACCUMULATION * MICRO_BATCH * (EVERY + 1) / 2)
    view = _run_view(server, run_id)
    assert view["records"] == STEPS // EVERY and view["last_step"] == STEPS and run.sent == STEPS // EVERY
    assert run.advice["run_id"] == run_id and "config" in run.advice and run.dropped == 0


def _plan_answers_once(server, not_modified: int, timeout_s: float = 30.0) -> dict[str, float]:
    """The server's plan answers once `not_modified` of them were 304s (or the timeout passed): a slow host asks less often."""
    deadline = time.monotonic() + timeout_s
    while (answers := plan_answers(server.url)).get("not_modified", 0) < not_modified and time.monotonic() < deadline:
        time.sleep(0.1)
    return answers


def test_advice_asked_again_without_new_telemetry_is_answered_304_and_kept(run_on_server):
    server, run_id = run_on_server
    run = _tula_run(server.url, run_id, plan_every_s=0.1)
    _train(run, STEPS)
    deadline = time.monotonic() + 60
    while (run.advice is None or run.advice["step"] != STEPS or run.buffered) and time.monotonic() < deadline:
        time.sleep(0.05)
    held = run.advice
    answers = _plan_answers_once(server, not_modified=3)  # more questions, no new telemetry
    run.close()
    assert answers.get("not_modified", 0) >= 3 and answers.get("cached", 0) == 0, answers
    assert run.advice is held and held["step"] == STEPS and run.last_error is None


def test_advice_asked_more_often_than_the_posts_does_not_post_at_its_pace(run_on_server):
    server, run_id = run_on_server
    run = _tula_run(server.url, run_id, plan_every_s=0.1, post_every_s=3600)
    _train(run, STEPS)  # 6 records, far from a post's worth
    deadline = time.monotonic() + 60
    while run.advice is None and time.monotonic() < deadline:
        time.sleep(0.05)
    answers = _plan_answers_once(server, not_modified=3)  # before close(), whose post may be followed by one more question
    assert run.advice is not None and run.sent == 0 and run.buffered == STEPS // EVERY
    assert answers.get("not_modified", 0) >= 3 and answers.get("computed") == 1, answers
    run.close()  # sends what is buffered
    assert run.sent == STEPS // EVERY and _run_view(server, run_id)["records"] == STEPS // EVERY


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


def test_a_full_buffer_does_not_make_the_sender_retry_a_dead_server_at_every_window(monkeypatch):
    """A full post's worth of records wakes the sender, but not while it waits out the backoff of a failed post:
    woken at every window's end, it tried a server that refused the connection once per window (1 074 times in
    100 000 steps of a tiny model), holding the interpreter the loop needed (34 us a step against 3 offline)."""
    monkeypatch.setattr("profiler.tula_run.MAX_RECORDS_PER_POST", 2)
    with socket.socket() as sock:  # a port nothing listens on once it is closed: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    run = _tula_run(dead, "run-1", timeout_s=0.5, plan_every_s=3600)
    for _ in range(4):
        _train(run, 50)  # 5 windows, each a post's worth and more
        time.sleep(0.02)  # the sender's turn to run, had it been woken
    assert run.buffered == 20 and 1 <= run.failed_posts <= 3  # the first full buffer's try, then its backoff (1 s)
    run.close(flush_timeout_s=0.1)


def test_the_short_path_of_a_plain_step_writes_what_the_general_path_writes(tmp_path):
    """GradientStatsLogger.plain_step takes most steps under sparse sampling; the records must not tell which path
    a step took. A loop that splits only the sampled steps, with steps of one, two and three passes, a smaller
    batch, no loss, a tensor loss and a metric among them, trained twice from the same seed: once as it runs, once
    with the short path refused (every step through step())."""
    short_steps: list[int] = []

    def train(short_path: bool, read_at_once: bool = True) -> list[dict]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        path = tmp_path / f"short-{short_path}-{read_at_once}.jsonl"
        run = TulaRun(None, "run-1", model, optimizer, offline_path=path, every=5, accumulation=ACCUMULATION, sample_every=8)
        run.logger._cpu_read_at_once = read_at_once
        plain_step = run.logger.plain_step

        def counted_plain_step(loss):
            passes = plain_step(loss) if short_path else None
            if passes is not None:
                short_steps.append(passes)
            return passes

        run.logger.plain_step = counted_plain_step
        taken = 0
        for step in range(60):
            optimizer.zero_grad()
            batch = 24 if step % 11 == 7 else 2 * MICRO_BATCH
            x = torch.randn(batch, 8)
            pieces = ACCUMULATION if run.sampling else (3 if step % 13 == 5 else 1 + step % 2)
            losses = []
            for xs in x.chunk(pieces):
                loss = torch.nn.functional.cross_entropy(model(xs), (xs[:, 0] > 0).long()) / pieces
                loss.backward()
                losses.append(loss.item())
            before = run.logger.steps
            value = None if step % 9 == 4 else (torch.tensor(sum(losses)) if step % 7 == 3 else sum(losses))
            run.step(loss=value, metric=0.5 if step % 10 == 6 else None)
            taken += run.logger.steps - before
            optimizer.step()
        run.close()
        assert taken == 60
        return [{k: v for k, v in json.loads(line).items() if k not in ("wall_time_s", "step_time_s")} for line in path.read_text().splitlines()]

    short, general = train(True), train(False)
    assert short == general and len(short) == 12
    assert any("grad_sqr" in r for r in short) and any("grad_sqr" not in r for r in short)
    assert len(short_steps) == 20 and set(short_steps) == {1, 2, 3}  # the others: sampled or next to it, a window's last, ...
    # a loss tensor kept for the window's end, as on a GPU (here: a CPU tensor with the read at once turned off)
    short_steps.clear()
    kept_short, kept_general = train(True, read_at_once=False), train(False, read_at_once=False)
    assert kept_short == kept_general == short and len(short_steps) == 25  # 20 as above and 5 with a tensor loss


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


def test_a_loop_without_accumulation_gives_its_per_sample_losses_and_reports_one_pass_of_its_batch(tmp_path):
    """run.backward(losses) in a one-process loop with no accumulation: statistics on the sampled steps (the batch's
    halves backpropagated one by one), every step one forward pass of the whole batch, and the records say so."""
    path = tmp_path / "telemetry.jsonl"
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = TulaRun(None, "run-1", model, optimizer, every=EVERY, offline_path=path, sample_every=5)
    torch.manual_seed(0)
    for _ in range(30):
        optimizer.zero_grad()
        x = torch.randn(ACCUMULATION * MICRO_BATCH, 8)
        loss = run.backward(torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long(), reduction="none"))
        run.step(loss=loss.item())
        optimizer.step()
    run.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["accumulation"], r["device_batch"]) for r in records] == [(10, 1, 32), (20, 1, 32), (30, 1, 32)]
    assert all(r["samples"] == r["step"] * 32 and r["trace_sigma"] > 0 and r["loss"] > 0 for r in records)


def test_records_of_a_loop_that_always_accumulates_say_so(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    run = _tula_run(None, "run-1", offline_path=path)
    _train(run, 20)
    run.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["accumulation"] == ACCUMULATION and r["device_batch"] == MICRO_BATCH for r in records)


def test_a_stability_measurement_goes_into_the_next_record_with_its_lr(tmp_path):
    from tula_service.runs.telemetry import TelemetryRecord

    path = tmp_path / "telemetry.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = TulaRun(None, "run-1", model, optimizer, every=EVERY, accumulation=ACCUMULATION, offline_path=path)
    run.model = model
    fixed = torch.randn(64, 8)
    measured = None
    for step in range(2 * EVERY):
        optimizer.zero_grad()
        for _ in range(ACCUMULATION):
            x = torch.randn(MICRO_BATCH, 8)
            (torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()) / ACCUMULATION).backward()
        run.step()
        optimizer.step()
        if step == 3:
            measured = run.measure_stability(lambda: torch.nn.functional.cross_entropy(model(fixed), (fixed[:, 0] > 0).long()))
    run.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert measured["lr"] == 0.05 and measured["stability_headroom"] == pytest.approx(2.0 / (0.05 * measured["sharpness"]))  # plain SGD
    assert (records[0]["stability_headroom"], records[0]["stability_lr"]) == (measured["stability_headroom"], 0.05)
    assert "stability_headroom" not in records[1] and records[0]["trace_sigma"] is not None  # the statistics go on as before
    assert TelemetryRecord.model_validate(records[0]).stability_lr == 0.05  # what the server takes


class _Clock:
    """Stands for the time module inside profiler.tula_run: the loop moves it, so step times are exact."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


def _steps_with_sampled_cost(run: TulaRun, clock: _Clock, steps: int, plain_s: float, sampled_s: float) -> None:
    """Steps that take plain_s on the clock and, when sampled, sampled_s (and the split into micro-batches)."""
    model = run.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(0)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(ACCUMULATION * MICRO_BATCH, 8)
        pieces = ACCUMULATION if run.sampling else 1
        clock.now += sampled_s if run.sampling else plain_s
        for xs in x.chunk(pieces):
            (torch.nn.functional.cross_entropy(model(xs), (xs[:, 0] > 0).long()) / pieces).backward()
        run.step()
        optimizer.step()


def test_an_overhead_budget_stretches_the_sampling_until_the_sampled_steps_fit_it(tmp_path, monkeypatch):
    """Plain steps of 2 ms, sampled ones of 6 ms (a clock the loop moves; the client's own calls take no time on
    it): with a budget of 20% of the step, overhead(n) = 2 x 4 ms / n / 2 ms <= 0.2 needs n >= 20, so from 4 the
    period doubles to 32. Windows without a sampled step still report their step time. Where a sampled step
    costs no more than a plain one, the densest sampling stays."""
    clock = _Clock()
    monkeypatch.setattr("profiler.tula_run.time", clock)
    path = tmp_path / "telemetry.jsonl"
    run = _tula_run(None, "run-1", offline_path=path, overhead_budget=0.2)
    assert run.logger.sample_every == 4  # at least BUDGET_MIN_SAMPLE_EVERY, so that plain steps exist to compare
    _steps_with_sampled_cost(run, clock, 200, plain_s=0.002, sampled_s=0.006)
    run.close()
    assert run.logger.sample_every == run.overhead["sample_every"] == 32
    assert run.overhead["within_budget"] and run.overhead["fraction"] == pytest.approx(2 * 0.004 / 32 / 0.002)
    assert run.overhead["sampled_step_extra_s"] == pytest.approx(0.004)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(EVERY, 201, EVERY))
    # the first window ran mostly sampled, split steps (0-1, 4-5, 8-9): its record says so; then plain steps
    assert (records[0]["step_time_s"], records[0]["accumulation"]) == (pytest.approx(0.006), ACCUMULATION)
    assert all((r["step_time_s"], r["accumulation"]) == (pytest.approx(0.002), 1) for r in records[1:])
    with_statistics = [r["step"] for r in records if "grad_sqr" in r]
    assert with_statistics == [10, 40, 70, 100, 130, 170, 200]  # the period set to 32 at step 10: pairs at 32-33, 64-65, ...

    same_cost = _tula_run(None, "run-2", offline_path=tmp_path / "same.jsonl", overhead_budget=0.2)
    _steps_with_sampled_cost(same_cost, clock, 60, plain_s=0.002, sampled_s=0.002)
    same_cost.close()
    assert same_cost.logger.sample_every == 4 and same_cost.overhead["within_budget"]

    for budget in (0, 1, -0.1):
        with pytest.raises(ValueError, match="overhead_budget"):
            _tula_run(None, "run-3", offline_path=tmp_path / "x.jsonl", overhead_budget=budget)


def test_the_budget_is_fitted_again_after_a_sampled_step_or_every_few_windows_not_at_every_window(tmp_path, monkeypatch):
    """The fit sorts hundreds of step times: at every window's end it cost more than the record on millisecond
    steps. With 2 steps in 1024 sampled, a window (EVERY steps) seldom holds a sampled step."""
    from profiler.tula_run import BUDGET_REFIT_WINDOWS

    clock = _Clock()
    monkeypatch.setattr("profiler.tula_run.time", clock)
    run = _tula_run(None, "run-1", offline_path=tmp_path / "t.jsonl", overhead_budget=0.02, sample_every=1024)
    fits: list[int] = []
    fit = run._fit_sampling_to_budget
    monkeypatch.setattr(run, "_fit_sampling_to_budget", lambda: (fits.append(run.logger.steps), fit())[1])
    _steps_with_sampled_cost(run, clock, 40 * EVERY, plain_s=0.002, sampled_s=0.004)
    run.close()
    # the first window holds the pair at steps 0-1; after it, only every BUDGET_REFIT_WINDOWS windows
    assert fits == [EVERY + k * BUDGET_REFIT_WINDOWS * EVERY for k in range(5)]  # 40 windows: 1 + 39 // 8 fits
    assert run.overhead is not None and run.overhead["sample_every"] == 1024


def test_the_cost_of_a_sampled_call_is_the_sampled_steps_not_every_steps(tmp_path, monkeypatch):
    """The client's call on a sampled step (its norms) costs far more than on a plain one. It belongs to what a
    sampled step adds, not to the cost of every step: counted there as well (the mean over every call, as before),
    the early dense sampling made the client look over budget on its own, and the period went to
    MAX_SAMPLE_EVERY (on digits_cnn_sgd in benchmarks/online.py the budget saw 60 us a call where a plain call
    took about 14). Plain steps: 2 ms of training and 0.01 ms in the call; sampled ones: 4 ms and 2 ms in the
    call. overhead(n) = (2 x 3.99 ms / n + 0.01 ms) / 2 ms <= 0.1 needs n >= 42: from 4 the period doubles to 64."""
    clock = _Clock()
    monkeypatch.setattr("profiler.tula_run.time", clock)
    run = _tula_run(None, "run-1", offline_path=tmp_path / "t.jsonl", overhead_budget=0.1)
    logger_step = run.logger.step

    def timed_step(**kwargs):
        clock.now += 0.002 if run.logger.sampling else 0.00001
        return logger_step(**kwargs)

    monkeypatch.setattr(run.logger, "step", timed_step)
    plain_step = run.logger.plain_step

    def timed_plain_step(loss):  # the short path of a plain step (GradientStatsLogger.plain_step), when it takes it
        passes = plain_step(loss)
        clock.now += 0.00001 if passes is not None else 0.0
        return passes

    monkeypatch.setattr(run.logger, "plain_step", timed_plain_step)
    _steps_with_sampled_cost(run, clock, 40, plain_s=0.002, sampled_s=0.004)
    run.close()
    assert run.overhead["client_call_s_per_step"] == pytest.approx(0.00001)
    assert run.overhead["client_s_per_step"] == pytest.approx(COST_PER_CALL_SECOND * 0.00001)  # outside the calls too
    assert run.overhead["sampled_step_extra_s"] == pytest.approx(0.006 - 0.002 - 0.00001)  # against a plain step, call included
    assert run.logger.sample_every == 64 and run.overhead["within_budget"]


def test_the_budget_picks_the_densest_doubling_of_the_period_that_fits_and_says_when_none_does(tmp_path):
    """overhead(n) = (2 x extra / n + c call) / (plain - (c - 1) call), with the step times set by hand: the client
    costs c = COST_PER_CALL_SECOND times its calls' seconds, the part outside them inside the loop's own seconds."""
    c = COST_PER_CALL_SECOND
    run = _tula_run(None, "run-1", offline_path=tmp_path / "t.jsonl", overhead_budget=0.02, sample_every=5)
    run._plain_work_s.extend([0.010] * 9)  # 10 ms of training (the client's cost outside its calls included)
    run._plain_call_s.extend([0.00004] * 9)  # and 0.04 ms in the client's own call
    run._sampled_s.extend([0.02004] * 3)  # a sampled step adds 10 ms
    run._fit_sampling_to_budget()
    bare_s = 0.010 - (c - 1) * 0.00004
    room_s = 0.02 * bare_s - c * 0.00004  # 0.111 ms with c = 2.2
    assert 5 * 2**5 < 2 * 0.010 / room_s <= 5 * 2**6  # so n = 320 (c = 1 would leave room for 0.16 ms: n = 160)
    assert run.logger.sample_every == 320 and run.overhead["step_s"] == pytest.approx(bare_s)
    assert run.overhead["fraction"] == pytest.approx((2 * 0.010 / 320 + c * 0.00004) / bare_s) and run.overhead["within_budget"]
    assert run.overhead["cost_per_call_second"] == c
    run._plain_call_s.clear()
    run._plain_call_s.extend([0.0001] * 9)  # the client alone costs 2.2% of the step: no period fits
    run._fit_sampling_to_budget()
    assert run.logger.sample_every == 1024 and not run.overhead["within_budget"]
    run.close()


def _ddp_budget_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """A DDP rank under an overhead budget whose sampled steps cost what its rank says: rank 0's 3x a plain step
    (its budget needs 2 steps in 32), rank 1's no more than a plain one (4 would do)."""
    import profiler.tula_run as tula_run

    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        clock = _Clock()
        tula_run.time = clock  # this process's own module: the loop moves the clock, as in the tests above
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        run = TulaRun(None, "run-1", model, optimizer, offline_path=f"{out_dir}/telemetry.jsonl", every=EVERY, overhead_budget=0.2)
        generator, records = torch.Generator().manual_seed(rank), []
        for _ in range(200):
            optimizer.zero_grad()
            clock.now += (0.006 if rank == 0 else 0.002) if run.sampling else 0.002
            x = torch.randn(MICRO_BATCH, 8, generator=generator)
            torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
            record = run.step(loss=0.5)
            optimizer.step()
            if record:
                records.append({key: record.get(key) for key in ("step", "samples", "grad_sqr", "trace_sigma")})
        run.close()
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"sample_every": run.logger.sample_every, "overhead": run.overhead, "records": records}))
        del run, model, optimizer  # DDP's reducer holds the process group: gone before it is destroyed


def test_ddp_ranks_under_a_budget_take_the_sparsest_period_any_of_them_needs(tmp_path):
    """Each rank fits the budget from its own step times, but a step's statistics are summed over the ranks: a rank
    that skips a step another samples voids it, so the ranks must sample the same steps. They agree, in one
    all-reduce where they all fit, on the sparsest period any of them needs (each within its budget): 32 here,
    where rank 1 alone would keep 4 (before, each kept its own)."""
    spawn_ranks(_ddp_budget_worker, (2, free_port(), str(tmp_path)), 2, [tmp_path / f"rank{rank}.json" for rank in (0, 1)])
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["sample_every"] for r in ranks] == [32, 32]
    assert ranks[0]["overhead"]["within_budget"] and ranks[1]["overhead"]["sample_every"] == 32
    assert ranks[0]["records"] == ranks[1]["records"]  # the same statistics on every rank
    with_statistics = [r["step"] for r in ranks[0]["records"] if r["grad_sqr"] is not None]
    assert with_statistics == [10, 40, 70, 100, 130, 170, 200]  # as in one process: pairs at 32-33, 64-65, ...
