"""A plain PyTorch training loop's link to a Tula run: telemetry out, advice in, never in the training
step's way (issue 17).

    run = TulaRun("http://tula:8000", RUN_ID, model, optimizer, accumulation=2, every=10)
    for inputs, targets in loader:
        optimizer.zero_grad()
        for x, t in zip(inputs.chunk(2), targets.chunk(2)):
            loss = F.cross_entropy(model(x), t) / 2
            loss.backward()
        run.step(loss=loss.detach())  # after the step's backward passes, before optimizer.step() (a CPU loop: loss.item())
        optimizer.step()
        advice = run.advice          # the latest GET /v1/runs/{id}/plan answer, or None
    run.close()

One process without accumulation: `loss = run.backward(F.cross_entropy(model(inputs), targets, reduction="none"))`
in place of `loss.backward()` (GradientStatsLogger.backward: the batch's two halves backpropagated one after the
other on the steps that take statistics, which the overhead budget counts like any sampled step's cost).

- Statistics: `profiler.reference_logger.GradientStatsLogger`, so they are DDP-correct at no extra pass
  (each rank's local gradient against the all-reduced one), and accumulation's micro-batches serve as well.
  Every `every` optimizer steps one telemetry record (tula_service.runs.telemetry.TelemetryRecord): step,
  samples, wall_time_s, step_time_s (the median of the seconds between step() calls over the window: the
  loop's whole step, data loading included), device_batch, accumulation, loss, metric, |G|^2, tr(Sigma),
  variability and the Adam pair.
- Step times say how the step ran. A forward pre-hook counts the model's training forward passes (grad
  enabled) in each step, and a record's step_time_s, accumulation and device_batch are those of the
  steps that ran as most of the window's steps did: a loop that splits its batch into micro-batches only
  on the steps that take statistics (sample_every > 1) and runs the others whole reports the whole steps
  (accumulation 1, device_batch the batch on one device), which is what it trains with. Without a counted
  pass (the loop calls a submodule, not the model) the `accumulation` argument stands.
- Overhead budget: with `overhead_budget=f` (e.g. 0.02) the client keeps its own cost near f of the step
  by taking statistics on fewer steps. At the end of a window that followed a sampled step (else every
  BUDGET_REFIT_WINDOWS windows) it estimates, from what it times (the loop's own seconds of a plain step, from
  one step() call's return to the next call, median t_plain over the last STEP_HISTORY; the mean seconds inside
  its step() calls on those steps, t_call, window ends included; a sampled step's seconds in all, both parts,
  median t_sampled over the last SAMPLED_HISTORY),
      overhead(n) = (2 (t_sampled - t_plain - t_call) / n + c t_call) / (t_plain - (c - 1) t_call),
  where c t_call is what the client costs every step: its calls and what they cost the loop outside them (the
  forward pre-hook, 3-8 us a step in a training loop here, and the Python work's toll on the torch calls around
  it), which it cannot time itself, so c = COST_PER_CALL_SECOND is measured by benchmarks/client_overhead.py
  (the whole fixed cost against plain steps over the calls' own timing) and assumed; the outside part lies
  inside t_plain, hence the denominator. t_sampled - t_plain - t_call is what a sampled step adds (the
  per-parameter norms, in the backward pass and in its step() call, and the split into micro-batches where the
  loop splits only for the statistics); intervals over PAUSE_FACTOR x the median plain step held a pause, an
  evaluation say, and are left out of both. It picks the smallest period n = sample_every x 2^j (at most
  MAX_SAMPLE_EVERY) with overhead(n) <= f; `overhead` holds the latest estimate, its parts, the c it assumed, and
  whether the budget is met (it cannot be when c t_call alone exceeds it). Fewer sampled steps make each window's
  |G|^2 and tr(Sigma) noisier (window_steps says how many steps each averages); a window with none still sends
  its record (samples, step time, loss) without statistics, with or without a budget, as does a window whose
  every step was left out of them (clipped, overflowed). Not counted: the sender thread's posts, which run beside
  the loop.
- The loss: on a GPU pass the tensor (loss.detach()), read at the window's end, so that step() never waits for the
  device; on a CPU pass the float the loop reads anyway (loss.item()): a tensor is read inside step(), and a second
  read of the same loss cost the loop 8-12 us a step on this repository's CPU tasks, as much as the rest of a call.
- Sending: a daemon thread posts the buffered records (at most MAX_RECORDS_PER_POST a request) with a
  timeout, every `post_every_s` seconds (sooner when a post's worth is buffered, unless the last post failed and
  its backoff is running: woken at every window's end, it retried a dead server that often): a post holds the
  interpreter for milliseconds, which a loop of millisecond steps would feel if it came every record. The
  training loop only appends to a deque. A failed post keeps the records and is retried with a
  backoff (RETRY_S doubling to MAX_RETRY_S); the server stores a step once, so a record re-sent after a
  timeout whose post did land is harmless. So a dead or restarting server costs the loop nothing: it keeps
  training and the buffer is sent when the server answers again. The buffer is bounded (MAX_BUFFERED
  records; past it the oldest are dropped and counted in `dropped`).
- Offline: with server=None the records go to `offline_path` as JSONL (one record a line); `upload(path,
  server, run_id)` sends such a file later, in posts of MAX_RECORDS_PER_POST.
- LR stability: `run.measure_stability(loss_fn)` between optimizer.step() and the next forward pass (every few
  hundred steps) measures how far the LR may still rise (profiler.sharpness); the next record carries it as
  stability_headroom with the LR it was measured at (stability_lr), and re-planning caps the advised LR there.
- Advice: the same thread GETs the run's plan every `plan_every_s` seconds; `advice` is the latest answer (a change's
  config carries apply_by_step: past that step it saves less than the run's hysteresis, so a loop that gets it later
  keeps its configuration). It
  sends the last answer's ETag back (If-None-Match), so that while no new telemetry has landed the server answers
  304 without re-planning, and the client keeps its answer without parsing one (0.35 ms of the client's interpreter
  against 0.65 ms for a whole answer, loopback, this repository's CPU).
- Under DDP only rank 0 sends and asks; every rank must call step() and close() (the statistics'
  all-reduce). Under an overhead budget the ranks agree on the sparsest period any of them needs (one
  all-reduce where they all fit it): a step's statistics are summed over the ranks, so all must sample it.
- Standard library HTTP (urllib), so a training environment needs nothing beyond torch.
"""

from __future__ import annotations

import collections
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from profiler.reference_logger import GradientStatsLogger

MAX_RECORDS_PER_POST = 1_000  # the server's bound per POST /v1/runs/{id}/telemetry
BUDGET_MIN_SAMPLE_EVERY = 4  # under a budget at least 2 steps in 4 run without statistics: the plain steps to compare
MAX_SAMPLE_EVERY = 1024  # the sparsest sampling a budget may ask for: one pair of steps in 1024
STEP_HISTORY = 256  # plain steps kept for the budget's median step time
SAMPLED_HISTORY = 16  # sampled steps kept for the median cost of a sampled step
BUDGET_REFIT_WINDOWS = 8  # without a new sampled step, the budget's period is fitted again every 8 windows
PAUSE_FACTOR = 10.0  # an interval over 10 x the median plain step held a pause (evaluation, checkpoint): not a step's cost
# What the client costs a training loop per second spent inside its step() calls: the calls plus what it costs outside
# them (the forward pre-hook, and the Python work's toll on the steps around it), which it cannot time itself. Measured
# by benchmarks/client_overhead.py (sampling off, against plain steps, over the calls' own timing) on this repository's
# CPU: 3.16 the median of three full runs after the plain step's short path (plain_step), 2.15 (2.08-3.20) since the
# statistics' emptied gradient-hook dicts come off autograd between pairs, which took 1.1-1.4 us per parameter tensor
# off every backward pass outside the calls (benchmarks/hook_residue.py; docs/validation/client_overhead.md); an
# assumption elsewhere (a GPU's is measured by benchmarks/gpu_check.py), and `overhead` says which value it assumed.
COST_PER_CALL_SECOND = 2.2
MAX_BUFFERED = 100_000
RETRY_S, MAX_RETRY_S = 1.0, 30.0
TELEMETRY_FIELDS = ("samples", "loss", "metric", "grad_sqr", "trace_sigma", "variability", "precond_grad_sqr", "precond_trace_sigma",
                    "stability_headroom", "stability_lr", "statistics_samples")


class TulaRun:
    """See the module docstring. server: the service's base URL, or None (offline: `offline_path` required).
    token: an API token, when the server wants one. timeout_s: per HTTP request. Other arguments are
    GradientStatsLogger's (every, accumulation, device_batch, loss_divided_by_accumulation, grad_scaler,
    sample_every: statistics on two consecutive steps in every n, to bound their cost on small models).
    post_every_s: seconds between posts of the buffered records. overhead_budget: the fraction of the step
    time the client may cost (module docstring); sample_every is then the densest sampling (at least
    BUDGET_MIN_SAMPLE_EVERY)."""

    def __init__(
        self,
        server: str | None,
        run_id: str,
        model: nn.Module,
        optimizer: Any = None,
        *,
        every: int = 20,
        accumulation: int = 1,
        device_batch: int | None = None,
        loss_divided_by_accumulation: bool = True,
        grad_scaler: Any = None,
        token: str | None = None,
        offline_path: str | Path | None = None,
        timeout_s: float = 2.0,
        plan_every_s: float = 30.0,
        sample_every: int = 1,
        post_every_s: float = 1.0,
        overhead_budget: float | None = None,
    ):
        if server is None and offline_path is None:
            raise ValueError("give the server's URL, or offline_path for the JSONL to upload later")
        if overhead_budget is not None and not 0 < overhead_budget < 1:
            raise ValueError(f"overhead_budget is a fraction of the step time in (0, 1), e.g. 0.02; got {overhead_budget!r}")
        self.overhead_budget = overhead_budget
        if overhead_budget is not None:
            sample_every = max(sample_every, BUDGET_MIN_SAMPLE_EVERY)
        self.min_sample_every = sample_every
        self.overhead: dict[str, float] | None = None  # the budget's latest estimate (module docstring)
        self.server, self.run_id, self.token, self.timeout_s, self.plan_every_s = server, run_id, token, timeout_s, plan_every_s
        self.post_every_s = post_every_s
        self.accumulation = accumulation
        self.logger = GradientStatsLogger(None, model, optimizer, every=every, accumulation=accumulation, device_batch=device_batch,
                                          loss_divided_by_accumulation=loss_divided_by_accumulation, grad_scaler=grad_scaler,
                                          sample_every=sample_every, counts_only_records=True)  # fmt: skip
        self.leader = self.logger.rank == 0
        self.advice: dict[str, Any] | None = None
        self._advice_etag: str | None = None
        self.sent = self.dropped = self.failed_posts = 0
        self.last_error: str | None = None
        self._offline = open(offline_path, "a") if offline_path is not None and self.leader else None
        self._buffer: collections.deque[dict[str, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._backing_off = False  # the last post failed: the sender waits its backoff out before it tries again
        self._started = time.perf_counter()
        self._last_step_at: float | None = None  # when the last step() was entered
        self._last_exit: float | None = None  # when it returned
        self._step_times: list[tuple[int, float]] = []  # (forward passes, seconds) per step of the window
        self._passes = 0
        # the budget's inputs (module docstring, Overhead budget): per plain step the loop's own seconds between two
        # step() calls and the seconds inside the call; per sampled step both together
        self._plain_work_s: collections.deque[float] = collections.deque(maxlen=STEP_HISTORY)
        self._plain_call_s: collections.deque[float] = collections.deque(maxlen=STEP_HISTORY)
        self._sampled_s: collections.deque[float] = collections.deque(maxlen=SAMPLED_HISTORY)
        self._sampled_count = self._sampled_count_at_fit = self._windows_since_fit = 0
        # the forward passes of a step: the logger's forward hook counts them already (one hook a pass, not two), except
        # with device_batch given, where it has none
        self._pass_hook = model.register_forward_pre_hook(self._count_pass) if self.logger.forward_passes is None else None
        self._thread = None
        if self.leader and server is not None:
            self._thread = threading.Thread(target=self._send_loop, name="tula-run-telemetry", daemon=True)
            self._thread.start()

    # -- the training loop's side: no network, no waiting ----------------------------------------------

    def _count_pass(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self._passes += 1

    def backward(self, losses: torch.Tensor) -> torch.Tensor:
        """loss.backward() from the per-sample losses, for one process without accumulation; the batch's mean loss
        (GradientStatsLogger.backward)."""
        return self.logger.backward(losses)

    def step(self, loss: float | torch.Tensor | None = None, metric: float | None = None) -> dict[str, Any] | None:
        """After the step's backward passes, before optimizer.step(); the telemetry record when this step
        closes a window, else None. loss: a float or a one-element tensor; on a GPU pass the tensor (loss.detach()),
        which is read at the window's end, not now (GradientStatsLogger.step); on a CPU the float the loop reads
        anyway (module docstring, The loss)."""
        entered = time.perf_counter()
        last_step_at, last_exit = self._last_step_at, self._last_exit
        if metric is None and last_exit is not None and self._pass_hook is None:  # the common step, kept short
            passes = self.logger.plain_step(loss)  # None: not such a step, nothing done
            if passes is not None:
                self._step_times.append((passes, entered - last_step_at))
                self._last_step_at = entered
                self._last_exit = exited = time.perf_counter()
                self._plain_work_s.append(entered - last_exit)
                self._plain_call_s.append(exited - entered)
                return None
        sampled = self.logger.sampling  # of the step now ending
        if self._last_step_at is not None:
            self._step_times.append((self._passes if self._pass_hook is not None else self.logger.forward_passes, entered - self._last_step_at))
        work_s = None if self._last_exit is None else entered - self._last_exit
        self._last_step_at, self._passes = entered, 0
        try:
            return self._step(loss, metric, entered)
        finally:
            self._last_exit = time.perf_counter()
            if work_s is not None:
                self._time_step(sampled, work_s, self._last_exit - entered)

    def _step(self, loss: float | torch.Tensor | None, metric: float | None, now: float) -> dict[str, Any] | None:
        stats = self.logger.step(loss=loss, metric=metric)
        if stats is None:
            return None
        record = self._record(stats, now)
        self._step_times = []
        if self.overhead_budget is not None and self._refit_due():
            self._fit_sampling_to_budget()
        if self.leader:
            if self._offline is not None:
                self._offline.write(json.dumps(record, allow_nan=False) + "\n")
                self._offline.flush()
            if self._thread is not None:
                with self._lock:
                    self._buffer.append(record)
                    while len(self._buffer) > MAX_BUFFERED:
                        self._buffer.popleft()
                        self.dropped += 1
                    full = len(self._buffer) >= MAX_RECORDS_PER_POST
                if full and not self._backing_off:  # after a failed post the sender waits out its backoff: woken at every
                    self._wake.set()  # window's end instead, it retried a dead server that often, holding the interpreter
        return record

    def _record(self, stats: dict[str, Any], now: float) -> dict[str, Any]:
        """The telemetry record of a window; its step time, accumulation and device batch are those of the
        window's most common number of forward passes per step (module docstring)."""
        world = self.logger.world_size
        counted = [passes for passes, _ in self._step_times if passes > 0]
        if counted and counted.count(counted[0]) == len(counted):  # every step alike: the usual window, kept cheap
            counts, passes = {counted[0]: len(counted)}, counted[0]
        else:
            counts = collections.Counter(counted)
            passes = max(counts, key=lambda n: (counts[n], n)) if counts else self.accumulation
        record = {"step": stats["step"], "wall_time_s": now - self._started, "accumulation": passes,
                  "device_batch": max(1, stats["batch"] // (world * passes))}  # fmt: skip
        times = [seconds for n, seconds in self._step_times if n == passes or not counts]
        if times:
            record["step_time_s"] = statistics.median(times)
        record.update({name: stats[name] for name in TELEMETRY_FIELDS if stats.get(name) is not None})
        return record

    def _time_step(self, sampled: bool, work_s: float, call_s: float) -> None:
        """A step's seconds for the budget: the loop's own (from the last step() call's return to this one) and this
        call's. A sampled step's are kept together (what it costs in all); a plain step's apart, the call being the
        client's cost on every step (window ends and budget fits amortized in it)."""
        if sampled:
            self._sampled_s.append(work_s + call_s)
            self._sampled_count += 1
        else:
            self._plain_work_s.append(work_s)
            self._plain_call_s.append(call_s)

    def _refit_due(self) -> bool:
        """Whether the budget's period is worth fitting again at this window's end: a sampled step has been
        timed since the last fit (the cost of one is the estimate's scarce input), or BUDGET_REFIT_WINDOWS
        windows have passed (the plain steps' median drifts slowly). The fit sorts hundreds of step times, so
        doing it at every window end cost more than the window's record on millisecond steps."""
        self._windows_since_fit += 1
        sampled_seen = self._sampled_count != self._sampled_count_at_fit
        if not sampled_seen and self._windows_since_fit < BUDGET_REFIT_WINDOWS:
            return False
        self._windows_since_fit, self._sampled_count_at_fit = 0, self._sampled_count
        return True

    def _fit_sampling_to_budget(self) -> None:
        """The sparsest-needed sampling period n for the overhead budget (module docstring, Overhead budget). Under
        DDP every rank fits it from its own timings, but the ranks must sample the same steps (a step's statistics
        are summed over the ranks, and a rank that skipped it voids it): they take the sparsest period any rank
        needs, in one all-reduce at the window's end where every rank fits (_refit_due counts windows and sampled
        steps, which the ranks share)."""
        fit = self._budget_fit()
        period = self.logger.sample_every if fit is None else self._period_for(fit["needed"])
        if self.logger.world_size > 1:
            period = self._sparsest_over_ranks(period)
        if period != self.logger.sample_every:
            self.logger.set_sample_every(period)
        if fit is not None:
            extra_s, client_s, bare_s = fit["sampled_step_extra_s"], fit["client_s_per_step"], fit["step_s"]
            self.overhead = {"fraction": (2.0 * extra_s / period + client_s) / bare_s, "sample_every": period,
                             "step_s": bare_s, "client_s_per_step": client_s, "client_call_s_per_step": fit["client_call_s_per_step"],
                             "cost_per_call_second": COST_PER_CALL_SECOND, "sampled_step_extra_s": extra_s,
                             "budget": self.overhead_budget, "within_budget": fit["room_s"] > 0 and period >= fit["needed"]}  # fmt: skip

    def _budget_fit(self) -> dict[str, float] | None:
        """This rank's estimate: the client's cost per step, what a sampled step adds, the step without the client,
        and the period needed (module docstring); None before a plain and a sampled step have been timed."""
        if not self._plain_work_s or not self._sampled_s:
            return None
        call_s = statistics.fmean(self._plain_call_s)  # a mean: the rare window ends' records count in proportion
        client_s = COST_PER_CALL_SECOND * call_s  # the calls and what they cost the loop outside them
        longest_s = PAUSE_FACTOR * statistics.median(self._plain_work_s)
        plain = [seconds for seconds in self._plain_work_s if seconds <= longest_s]
        sampled = [seconds for seconds in self._sampled_s if seconds <= longest_s]
        if not sampled:
            return None
        work_s = statistics.median(plain)  # the loop's own seconds, which hold the client's cost outside its calls
        extra_s = max(statistics.median(sampled) - work_s - call_s, 0.0)
        bare_s = max(work_s - (client_s - call_s), 1e-9)  # the step without the client
        room_s = self.overhead_budget * bare_s - client_s
        return {"client_call_s_per_step": call_s, "client_s_per_step": client_s, "sampled_step_extra_s": extra_s,
                "step_s": bare_s, "room_s": room_s, "needed": MAX_SAMPLE_EVERY if room_s <= 0 else 2.0 * extra_s / room_s}  # fmt: skip

    def _period_for(self, needed: float) -> int:
        """The densest sample_every x 2^j >= needed, at most MAX_SAMPLE_EVERY (never denser than asked)."""
        period = self.min_sample_every
        while period < needed and period < MAX_SAMPLE_EVERY:
            period *= 2
        return min(period, max(MAX_SAMPLE_EVERY, self.min_sample_every))

    def _sparsest_over_ranks(self, period: int) -> int:
        value = torch.tensor([period], dtype=torch.int64, device=self.logger._device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.logger.process_group)
        return int(value.item())

    def measure_stability(self, loss_fn: Any) -> dict[str, float] | None:
        """The LR stability headroom now (GradientStatsLogger.measure_stability): the next record carries it, and
        re-planning caps the LR it advises there. Call it between optimizer.step() and the next forward pass, every
        few hundred steps (about 2 x 20 backward passes of loss_fn); the interval it sits in is a pause to the
        overhead budget (over PAUSE_FACTOR x a step), not a step's cost."""
        return self.logger.measure_stability(loss_fn)

    @property
    def sampling(self) -> bool:
        """Whether the coming step takes statistics (GradientStatsLogger.sampling): with sample_every > 1, a
        loop that splits its batch in micro-batches only for the statistics may run the other steps whole."""
        return self.logger.sampling

    @property
    def buffered(self) -> int:
        with self._lock:
            return len(self._buffer)

    # -- the sender thread ------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        """Posts when its time has come (post_every_s, or the backoff after a failed post) or when woken (a post's worth
        buffered, close()); asks for advice when its own time has come. Woken for one, it does not do the other early: a
        plan_every_s shorter than post_every_s used to post at the plan's pace, so that every question followed new
        telemetry and the server re-planned for each."""
        backoff, now = RETRY_S, time.monotonic()
        next_post = next_plan = now
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_post or self._wake.is_set():
                self._wake.clear()
                sent_all = self._send_buffered()
                self._backing_off = not sent_all
                next_post = time.monotonic() + (self.post_every_s if sent_all else backoff)
                backoff = RETRY_S if sent_all else min(backoff * 2, MAX_RETRY_S)
            if time.monotonic() >= next_plan:
                self._fetch_advice()
                next_plan = time.monotonic() + self.plan_every_s
            self._wake.wait(timeout=max(0.0, min(next_post, next_plan) - time.monotonic()))

    def _send_buffered(self) -> bool:
        """Post what is buffered, a post at a time; False when a post failed (the records stay)."""
        while True:
            with self._lock:
                batch = [self._buffer[i] for i in range(min(MAX_RECORDS_PER_POST, len(self._buffer)))]
            if not batch:
                return True
            try:
                self._request("POST", f"/v1/runs/{self.run_id}/telemetry", {"records": batch})
            except (OSError, ValueError) as error:  # urllib's URLError and HTTPError are OSErrors
                self.failed_posts += 1
                self.last_error = f"{type(error).__name__}: {error}"
                return False
            with self._lock:
                for _ in batch:
                    if self._buffer:
                        self._buffer.popleft()
            self.sent += len(batch)

    def _fetch_advice(self) -> None:
        headers = {"If-None-Match": self._advice_etag} if self._advice_etag and self.advice is not None else {}
        try:
            answer, etag = http_json_with_etag(self.server, "GET", f"/v1/runs/{self.run_id}/plan", None, self.token, self.timeout_s, headers)
        except urllib.error.HTTPError as error:
            if error.code != 304:  # 304: the answer held still stands
                self.last_error = f"{type(error).__name__}: {error}"
            return
        except (OSError, ValueError) as error:
            self.last_error = f"{type(error).__name__}: {error}"
            return
        self.advice, self._advice_etag = answer, etag

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        return http_json(self.server, method, path, body, self.token, self.timeout_s)

    # -- the end ------------------------------------------------------------------------------------------

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Writes the last window (a collective under DDP), then gives the sender up to `flush_timeout_s` to
        post what is buffered; what is left stays in `offline_path` (when given) for `upload`."""
        previous = self.logger.last_record
        self.logger.close()  # writes the last, partial window
        if self._pass_hook is not None:
            self._pass_hook.remove()
        last = self.logger.last_record
        if last is not None and last is not previous and self.leader:
            record = self._record(last, time.perf_counter())
            if self._offline is not None:
                self._offline.write(json.dumps(record, allow_nan=False) + "\n")
            if self._thread is not None:
                with self._lock:
                    self._buffer.append(record)
        if self._thread is not None:
            deadline = time.monotonic() + flush_timeout_s
            self._wake.set()
            while self.buffered and time.monotonic() < deadline and self._thread.is_alive():
                time.sleep(0.05)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=self.timeout_s + 1)
        if self._offline is not None:
            self._offline.close()

    def __enter__(self) -> TulaRun:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()


def http_json(server: str, method: str, path: str, body: dict | None, token: str | None, timeout_s: float) -> Any:
    """One JSON request; raises urllib's errors (OSError) or ValueError for a body that is not JSON."""
    return http_json_with_etag(server, method, path, body, token, timeout_s)[0]


def http_json_with_etag(server: str, method: str, path: str, body: dict | None, token: str | None, timeout_s: float,
                        headers: dict[str, str] | None = None) -> tuple[Any, str | None]:  # fmt: skip
    """One JSON request: (the answer, its ETag or None); raises urllib's errors (OSError; a 304 is an HTTPError with
    code 304) or ValueError for a body that is not JSON."""
    data = json.dumps(body, allow_nan=False).encode() if body is not None else None
    request = urllib.request.Request(server.rstrip("/") + path, data=data, method=method, headers=headers or {})
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null"), response.headers.get("ETag")


def upload(path: str | Path, server: str, run_id: str, token: str | None = None, timeout_s: float = 30.0) -> dict[str, int]:
    """Send an offline JSONL file to the run, MAX_RECORDS_PER_POST a post; {"accepted", "duplicates"} summed
    (steps the run holds already, from an earlier upload or the live sender, are duplicates)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    totals = {"accepted": 0, "duplicates": 0}
    for start in range(0, len(records), MAX_RECORDS_PER_POST):
        receipt = http_json(server, "POST", f"/v1/runs/{run_id}/telemetry", {"records": records[start : start + MAX_RECORDS_PER_POST]}, token, timeout_s)
        totals["accepted"] += receipt["accepted"]
        totals["duplicates"] += receipt["duplicates"]
    return totals
