"""Gradient statistics along the user's own PyTorch training run, written as Tula's JSONL records.

Two lines in a plain loop (then `tula submit SPEC --reference-stats stats.jsonl`):

    logger = GradientStatsLogger("stats.jsonl", model, optimizer, every=20)   # once, after wrapping in DDP
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()                        # under DDP: returns after the all-reduce
        logger.step(loss=loss.detach())        # after backward(), before optimizer.step()
        optimizer.step()
    logger.close()                             # or `with GradientStatsLogger(...) as logger:`

One process without accumulation: give the logger the per-sample losses and let it run the backward pass:

    logger = GradientStatsLogger("stats.jsonl", model, optimizer, every=20, sample_every=10)
    for inputs, targets in loader:
        optimizer.zero_grad()
        losses = F.cross_entropy(model(inputs), targets, reduction="none")   # one loss per sample
        loss = logger.backward(losses)         # instead of loss.backward(); returns the batch's mean loss
        logger.step(loss=loss)
        optimizer.step()

On a step that takes statistics, backward() runs two backward passes through the same graph, one per half of
the batch (the first keeps the graph for the second), so the hooks see two half-batch gradients and .grad ends as
the whole batch's; on the other steps one backward pass of the mean. That second backward pass is the mode's
cost, on the sampled steps only: with sample_every=n (statistics on 2 steps in n) 2/n of a backward pass a step
on average, a fifth at n = 10.

One process with accumulation: accumulate k micro-batches per step and say so (the small batches of the estimator):

    logger = GradientStatsLogger("stats.jsonl", model, optimizer, every=20, accumulation=4)
    for inputs, targets in loader:
        optimizer.zero_grad()
        for x, t in zip(inputs.chunk(4), targets.chunk(4)):
            (F.cross_entropy(model(x), t) / 4).backward()
        logger.step()
        optimizer.step()

The loss may be a float or a one-element tensor. Pass the tensor (`loss.detach()`) on a GPU: `loss.item()`
waits for the device before optimizer.step() can be launched, which on a step of a millisecond or two
costs a sizeable share of it; a tensor stays on the device until the window's end, where all of the
window's losses come back in one copy with its statistics. A tensor on the CPU is read at once (there is
nothing to wait for, and a float costs less to keep than a tensor view).

The samples per micro-batch are read from each forward pass's first tensor argument (dim 0); pass
`device_batch=` when that is not the batch (dict inputs keyed otherwise, sequence-first tensors, a
model called twice per micro-batch).

Estimator: the two-batch one of McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", App. A.1), `profiler.gradstats.two_batch_estimates`. With n gradients g_b of b samples each
whose mean is the step's gradient g_B of B = n b samples:

    |G|^2     ~ (B |g_B|^2 - b mean|g_b|^2) / (B - b)
    tr(Sigma) ~ (mean|g_b|^2 - |g_B|^2) / (1/b - 1/B)          per sample: B_simple = tr(Sigma) / |G|^2

Where the two batches come from, at no extra forward or backward pass:
- DistributedDataParallel over W ranks: each rank's local gradient (b = per-device batch) is read by
  a tensor hook on every parameter, which autograd runs before the gradient is accumulated and DDP
  all-reduces it; g_B is `.grad` after backward (B = W b). mean|g_b|^2 is the mean over the ranks.
- Gradient accumulation over k micro-batches (`accumulation=k`, one process, or DDP with `no_sync()`
  on all but the last micro-batch): the same hooks see each micro-batch's own gradient, so the small
  batch is the micro-batch (b = its samples, B = W k b, mean over all W k micro-batches).
- One process without accumulation (`logger.backward(losses)`): the two halves of the batch, b = B / 2, each
  backpropagated on its own on the sampled steps (a second backward pass, no second forward). The hooks see
  (b / B) g_b = g_b / 2, as accumulation=2 with `(loss / 2).backward()` would show them. A batch of odd size splits
  into unequal halves, and the step counts its samples but gives no statistics (as any step whose micro-batches
  differ in size). A step with one gradient and neither DDP, accumulation nor backward() has nothing to compare:
  step() refuses it, naming these three ways.

Hooks rather than a DDP communication hook: a model keeps its own comm hook (fp16 compression,
PowerSGD: DDP takes only one), the micro-batches of `no_sync()` accumulation stay visible, and the
code path is the same with and without DDP.

Loss scaling. Each micro-batch's loss is the mean over its samples (PyTorch's default reduction).
With `loss_divided_by_accumulation=True` (the usual `(loss / k).backward()`) the hook sees g_b / k and
`.grad` holds g_B; with False, the hook sees g_b and `.grad` holds k g_B. Either way the logger
converts to g_b and g_B. A wrong setting scales grad_sqr and trace_sigma by the same k^2: their ratio,
B_simple, does not change.

AMP. With `grad_scaler=` (torch.amp.GradScaler), step() calls `grad_scaler.unscale_(optimizer)` (a
no-op if the loop already did, e.g. to clip), so `.grad` is the true gradient and
`grad_scaler.step(optimizer)` does not unscale again; the hooks saw scaled gradients and are divided
by the scale squared. A step whose gradients are inf/nan (the scaler skips it) counts its samples
but gives no statistics.

Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, Adagrad, Adafactor. precond_grad_sqr and precond_trace_sigma are the same two estimates for P g with
P = diag(1 / (sqrt(v) + eps)), v the optimizer's second moment (Adam and NAdam: exp_avg_sq / (1 - beta2^t),
max_exp_avg_sq with amsgrad; RMSprop: square_avg, less grad_avg^2 when centered; RAdam's P is
sqrt(1 - beta2^t) / (sqrt(exp_avg_sq) + eps), Adamax's 1 / exp_inf, Adagrad's 1 / (sqrt(sum) + eps), Adafactor's
relative step over the root of its factored second moment: profiler.preconditioner)
as the coming optimizer.step() divides by it: g_B folded into the second moment the way the step folds it
(profiler.preconditioner.coming_step_denominators), the same P for every micro-batch gradient and for g_B. The hooks
keep each adaptive parameter's micro-batch gradients squared and summed per coordinate until step() knows g_B. On the
first step the state is empty: null.

Windows. Every `every` optimizer steps one record: |G|^2 and tr(Sigma) averaged over the window's
steps separately (never per-step ratios), samples (all ranks, cumulative), batch (global), step,
loss (mean over the window, over the ranks too), metric (the last one passed in the window, rank 0's),
window_steps, variability (median over the window of | |g_t| - |g_t-1| | / |g_t-1|, g_t the step's
global gradient), the precond pair, and statistics_samples: where the statistics were taken, the mean over the
steps they average of the samples seen after each (samples is the window's end; with sparse sampling the two
differ by up to a window, and a window's pair may be its first two steps, at the initial weights in the first
window: the service places the record's noise scale at statistics_samples). Steps whose micro-batches differ in size (an epoch's last,
smaller batch) count their samples but are left out of the statistics. Rank 0 writes and flushes each
line, so a crash loses at most one window; every rank gets the record back from step().

Cost: per backward, one norm per parameter (with an adaptive optimizer also its gradient squared into a sum:
one float32 copy of those parameters, held during a sampled step's backward passes); per step, one pass over `.grad`
(two, and the preconditioner's few element-wise passes, with an adaptive optimizer); per
window, one all-reduce of a (steps x 10) tensor. Sampling: with `sample_every=n` (n >= 2) only two
consecutive steps in every n take statistics (steps s with s % n in {0, 1}, so the step-to-step
variability keeps a pair); the others count their samples and loss, with the per-parameter hooks
removed (registered again for the next pair; the accumulation count is checked on sampled steps).
Such a step need not be split: `logger.sampling` says whether the coming step takes statistics, so a
loop that splits its batch only for the statistics can run the other steps as one pass (their
samples are read from the forward passes, whatever their number). `set_sample_every(n)` changes the
period during the run (TulaRun's overhead budget does). A window without a sampled step (n > every)
writes no record, unless `counts_only_records=True`: then its record has the counts (samples, batch,
step, loss, metric, window_steps 0) and null statistics, which a telemetry record allows and the
reference-run contract does not (so the JSONL of a reference run should keep the default).
On a small model whose step takes milliseconds the norms cost a tenth or more of the step
(benchmarks/online.py measures it); sampling divides that by n / 2, and the window's estimates average
fewer steps (window_steps says how many). No host synchronization per step, except
`grad_scaler.get_scale()` under AMP.

LR stability. `logger.measure_stability(loss_fn)` between optimizer.step() and the next forward pass (every
few hundred steps; about 2 x 20 backward passes of loss_fn on a fixed batch) measures how far the LR could
grow before the top Hessian direction is unstable (profiler.sharpness), and the next record carries the
most restrictive since the last (the smallest largest-stable-LR, headroom x LR) as "stability_headroom", with
the LR it was measured at as "stability_lr": the service caps the LR it advises there.

Not supported: FSDP, ZeRO or tensor parallelism (a rank holds a shard, not a gradient), and other
backward passes through the model's parameters between two step() calls (they would count as
micro-batches: step() then raises).
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from profiler import preconditioner
from profiler.gradstats import two_batch_estimates
from profiler.sharpness import stability_headroom, training_left_as_it_was

RECORD_KEYS = (
    "samples", "batch", "grad_sqr", "trace_sigma", "loss", "metric", "step",
    "window_steps", "variability", "precond_grad_sqr", "precond_trace_sigma", "statistics_samples",
)  # fmt: skip

# One row per optimizer step; summed over the ranks at the end of a window (one all-reduce).
DEVICE_COLUMNS = 4
MICRO_SQ, FULL_SQ, PRE_MICRO_SQ, PRE_FULL_SQ = range(DEVICE_COLUMNS)  # device values: sums of squared norms
LOSS_SUM, LOSS_COUNT, MICRO_COUNT, SAMPLES, SAMPLES_SQ, PRE_OK = range(DEVICE_COLUMNS, DEVICE_COLUMNS + 6)  # host values

# The precond pair weighs each micro-batch's gradient by the P of this step, which is known only once the step's
# gradient is (the optimizer folds it into its second moment before it divides: profiler.preconditioner), so on a
# sampled step the hooks keep, per adaptive parameter, the sum of its micro-batches' squared gradients (float32, one
# parameter-sized tensor each, freed at step()) and step() weighs it by P^2. P read from the state before the step
# instead counted a coordinate whose second moment was still 0 (a unit that had not had a gradient yet) at 1 / eps:
# records' preconditioned noise scales of 1e7-1e9 on the digits MLP under Adamax and under centered RMSprop, and the
# reference run read 18 483 and 20 917 where the P the steps divided by gives 54 and 118 (docs/validation.md, "The
# coming step's preconditioner"). Those sums are memory the training loop did not budget for: past
# PRECOND_SQUARES_BYTES (the adaptive parameters' float32 size) the logger gives no precond pair (the service then reads
# the raw pair and says so) and warns, unless precond_max_bytes says otherwise.
PRECOND_SQUARES_BYTES = 2**30

ONE_GRADIENT = "one process with accumulation=1 has one gradient per step: the two-batch estimator has nothing to compare."
NOTHING_TO_COMPARE = (
    ONE_GRADIENT + " Call logger.backward(losses) with the per-sample losses (reduction='none') instead of "
    "loss.backward(), and it backpropagates the two halves of the batch on the steps that take statistics; or "
    "split each batch into k >= 2 micro-batches, call (loss / k).backward() on each, then logger.step(), and pass "
    "accumulation=k; or run under DistributedDataParallel, where the ranks' local gradients are the small batches"
)


@dataclass
class _StepTally:
    """What the hooks saw since the last step(): backward calls per parameter, forward batch sizes,
    norms of each backward's gradient per parameter, and for the precond pair their squares summed per coordinate."""

    backward_counts: Counter[int] = field(default_factory=Counter)
    forward_sizes: list[int | None] = field(default_factory=list)
    micro_norms: list[torch.Tensor] = field(default_factory=list)  # float32 norms, squared in one call at step()
    # per adaptive parameter, the sum over this step's backward passes of its gradient squared (float32), which step()
    # weighs by this step's P^2
    square_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    split_sizes: list[int] | None = None  # the halves backward() backpropagated one by one, on a sampled step


class GradientStatsLogger:
    """Writes gradient-statistics records of a training run to a JSONL file (see the module docstring).

    path: the JSONL file (rank 0 writes it); None writes none (the records are only returned by step(), as
    TulaRun takes them). model: the module as trained (the DDP wrapper under DDP).
    optimizer: for the precond pair of an adaptive optimizer (profiler.preconditioner.is_adaptive) and for grad_scaler's unscaling; optional otherwise.
    every: optimizer steps per record. accumulation: micro-batches (backward calls) per optimizer step
    on each rank. device_batch: samples per micro-batch on one rank; None reads it from each forward
    pass's first tensor argument (its dim 0). loss_divided_by_accumulation: whether each micro-batch's
    loss is divided by `accumulation` before backward(). grad_scaler: torch.amp.GradScaler under AMP.
    start_step, start_samples: counts already done (a resumed run); append: add to an existing file.
    sample_every, counts_only_records: see the module docstring (Sampling). precond_max_bytes: the most memory the precond
    pair's per-coordinate sums may take (float32, the size of the adaptive optimizer's parameters), PRECOND_SQUARES_BYTES
    by default; a larger model gets no precond pair, with a warning; None: no limit.
    """

    def __init__(
        self,
        path: str | Path | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int = 20,
        accumulation: int = 1,
        device_batch: int | None = None,
        loss_divided_by_accumulation: bool = True,
        grad_scaler: Any = None,
        start_step: int = 0,
        start_samples: int = 0,
        append: bool = False,
        sample_every: int = 1,
        counts_only_records: bool = False,
        precond_max_bytes: int | None = PRECOND_SQUARES_BYTES,
    ):
        counts = {"every": (every, 1), "sample_every": (sample_every, 1), "accumulation": (accumulation, 1), "device_batch": (1 if device_batch is None else device_batch, 1),
                  "start_step": (start_step, 0), "start_samples": (start_samples, 0)}  # fmt: skip
        for name, (value, least) in counts.items():
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        if grad_scaler is not None and optimizer is None:
            raise ValueError("grad_scaler needs the optimizer: GradScaler unscales the gradients per optimizer")
        self.process_group, self.world_size, self.rank = _distributed_setup(model)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self._model_buffers = list(model.buffers())  # batch norm's running statistics: measure_stability leaves them
        if not self.parameters:
            raise ValueError("the model has no parameter that requires a gradient")
        self.optimizer = optimizer
        self.every = every
        self.accumulation = accumulation
        self.device_batch = device_batch
        self.loss_divided_by_accumulation = loss_divided_by_accumulation
        self.grad_scaler = grad_scaler
        self.steps = start_step
        self.samples = start_samples
        self.sample_every = sample_every
        self._pending_sample_every: int | None = None
        self.counts_only_records = counts_only_records
        self.last_record: dict[str, Any] | None = None
        self._device = self.parameters[0].device
        self._one_device = len({p.device for p in self.parameters}) == 1
        self._dtype = torch.float32 if self._device.type == "mps" else torch.float64
        self._adaptive_groups = _adaptive_groups(optimizer, self.parameters)
        squares_bytes = 4 * sum(self.parameters[i].numel() for i in self._adaptive_groups)
        if precond_max_bytes is not None and squares_bytes > precond_max_bytes:
            warnings.warn(
                f"the precond pair would keep {squares_bytes / 2**20:.0f} MiB of float32 sums on a sampled step, past "
                f"precond_max_bytes ({precond_max_bytes / 2**20:.0f} MiB): the records carry no precond pair (the service reads "
                "the raw gradient's and says so); pass precond_max_bytes=None (or larger) to keep it",
                stacklevel=2,
            )  # fmt: skip
            self._adaptive_groups = {}
        self._rows_device: list[torch.Tensor] = []
        self._rows_host: list[list[float]] = []
        self._losses_device: list[tuple[int, torch.Tensor]] = []  # (row, loss) of the steps given a tensor loss
        self._metric: float | None = None
        self._stability: tuple[float, float] | None = None  # (headroom, LR) of the most restrictive measurement
        self._prev_norm: float | None = None
        self._tally = _StepTally()
        self._cpu_read_at_once = "cpu" in self.READ_AT_ONCE
        self._hooks = []  # the forward hook: every step
        self._grad_hooks: list[Any] = []  # per parameter: only on the steps that take statistics
        if device_batch is None:
            self._hooks.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        self._hook_gradients(self.sampling)
        self._file = open(path, "a" if append else "w") if self.rank == 0 and path is not None else None
        self._closed = False

    # -- during backward ---------------------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.dim() > 0:  # model(x): every step's pass, so kept short
                self._tally.forward_sizes.append(first.shape[0])
            else:
                self._tally.forward_sizes.append(_leading_dim(args, kwargs))

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        """Autograd calls this with the parameter's gradient from this backward pass alone (before it is
        accumulated into .grad and before DDP all-reduces it)."""
        grad, tally = grad.detach(), self._tally
        tally.backward_counts[index] += 1
        tally.micro_norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        if index in self._adaptive_groups:
            square = grad.square() if grad.dtype == torch.float32 else grad.float().square()
            kept = tally.square_sums.get(index)
            tally.square_sums[index] = square if kept is None else kept.add_(square)

    def _hook_gradients(self, wanted: bool) -> None:
        """Registers the per-parameter hooks for a step that takes statistics, removes them for one that does not."""
        if wanted and not self._grad_hooks:
            self._grad_hooks = [p.register_hook(partial(self._on_grad, index)) for index, p in enumerate(self.parameters)]
        elif not wanted and self._grad_hooks:
            for hook in self._grad_hooks:
                hook.remove()
            self._grad_hooks = []
            _unregister_empty_hook_dicts(self.parameters)

    READ_AT_ONCE = frozenset({"cpu"})  # devices whose tensor losses are read in step(): no asynchronous queue to wait on

    @property
    def forward_passes(self) -> int | None:
        """The forward passes with gradients since the last step(), as the forward hook counted them; None when
        device_batch was given (no hook counts them)."""
        return len(self._tally.forward_sizes) if self._hooks else None

    @property
    def sampling(self) -> bool:
        """Whether the step under way takes statistics (module docstring, Sampling)."""
        return self.sample_every == 1 or self.steps % self.sample_every in (0, 1)

    def set_sample_every(self, sample_every: int) -> None:
        """Changes the sampling period from the coming step on; during a pair (the coming step is its second)
        the change waits until the pair is done, so the step-to-step variability keeps it. The next pair
        starts at the next step s with s % sample_every == 0."""
        if not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(f"sample_every must be a whole number >= 1, got {sample_every!r}")
        if self.sample_every > 1 and self.steps % self.sample_every == 1:
            self._pending_sample_every = sample_every
            return
        self._pending_sample_every = None
        self.sample_every = sample_every
        self._hook_gradients(self.sampling)

    def _sum_of_squares(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """sum |x|^2 over float32 norms, squared in the rows' dtype where the rows are kept: in one call on one device (the
        hooks keep the norms, not their squares, so that each costs them one kernel), else norm by norm."""
        if self._one_device:
            return torch.stack(norms).to(self._device, self._dtype).square().sum()
        return torch.stack([norm.to(self._device, self._dtype) for norm in norms]).square().sum()

    def backward(self, losses: torch.Tensor) -> torch.Tensor:
        """The step's backward pass from its per-sample losses (reduction="none"; shape (batch, ...), a sample's
        loss the mean over its other dims, as cross-entropy's mean over a sequence's tokens), in place of
        loss.backward(); returns the batch's mean loss, detached. For one process without accumulation, on a step
        that takes statistics: the two halves of the batch backpropagated one after the other (module docstring),
        .grad ending as the mean's gradient. Otherwise one backward pass of the mean (divided by accumulation when
        loss_divided_by_accumulation, for a micro-batch). Under AMP the grad_scaler scales what it backpropagates."""
        if not isinstance(losses, torch.Tensor) or losses.dim() == 0 or losses.shape[0] == 0:
            raise ValueError("backward() takes the per-sample losses (reduction='none'): a tensor of shape (batch, ...)")
        per_sample = losses.reshape(losses.shape[0], -1).mean(dim=1) if losses.dim() > 1 else losses
        batch, scaler = per_sample.shape[0], self.grad_scaler
        split = self.world_size == 1 and self.accumulation == 1 and self.sampling and batch >= 2
        if not split:
            total = per_sample.mean()
            if self.accumulation > 1 and self.loss_divided_by_accumulation:
                total = total / self.accumulation
            (total if scaler is None else scaler.scale(total)).backward()
            return per_sample.detach().mean()
        half = batch // 2
        for part, keep_graph in ((per_sample[:half], True), (per_sample[half:], False)):
            share = part.sum() / batch  # (b / B) of the half's mean: the halves' gradients sum to the batch mean's
            (share if scaler is None else scaler.scale(share)).backward(retain_graph=keep_graph)
        self._tally.split_sizes = [half, batch - half]
        return per_sample.detach().mean()

    # -- once per optimizer step -------------------------------------------------------------------

    def step(self, loss: float | torch.Tensor | None = None, metric: float | None = None) -> dict[str, Any] | None:
        """After the step's last backward() (and DDP's all-reduce), before optimizer.step().

        loss: this rank's training loss of the step (averaged over the ranks and the window): a float, or a
        one-element tensor, which is read at the window's end rather than now (module docstring).
        metric: an evaluation metric, when there is one (the record keeps the window's last).
        Returns the record when this step closes a window (on every rank), else None."""
        if self._closed:
            raise RuntimeError("step() after close(): make a new GradientStatsLogger")
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss must be a float or a one-element tensor, got a tensor of shape {tuple(loss.shape)}")
            # nothing to wait for: a float now is cheaper than a view kept. (loss.device builds a torch.device, which cost
            # more than the rest of a plain step's call in a training loop: is_cpu and is_cuda are plain attributes.)
            if self._cpu_read_at_once if loss.is_cpu else (not loss.is_cuda and loss.device.type in self.READ_AT_ONCE):
                loss = loss.item()
        sampling = self.sampling
        if not sampling:  # no gradient hooks ran, only the forward sizes were tallied: count the samples and the loss
            forward_sizes, self._tally.forward_sizes = self._tally.forward_sizes, []  # a step that raises below is dropped
            sizes = self._unsampled_sizes(forward_sizes)
            squared_norms, precond_ok, micro_batches = None, False, self.accumulation
        else:
            tally, self._tally = self._tally, _StepTally()  # a step that raises below is dropped
            micro_batches = max(tally.backward_counts.values(), default=0)
            if micro_batches == 0:
                raise RuntimeError("step() found no backward pass since the last step: call it after backward(), before optimizer.step()")
            expected = self.accumulation if tally.split_sizes is None else len(tally.split_sizes)
            if micro_batches != expected:
                raise ValueError(
                    f"{micro_batches} backward passes since the last step, but accumulation={self.accumulation}: pass the number "
                    "of micro-batches per optimizer step (and run no other backward pass through the model between steps)"
                )
            if micro_batches == 1 and self.world_size == 1:
                raise ValueError(NOTHING_TO_COMPARE)
            sizes = tally.split_sizes or self._micro_sizes(tally.forward_sizes, micro_batches)
            squared_norms, precond_ok = self._squared_norms(tally, micro_batches, divided=True if tally.split_sizes else None)
        self._add_row(squared_norms, loss, micro_batches, sizes, precond_ok)
        if metric is not None:
            self._metric = float(metric)
        self.steps += 1
        if self._pending_sample_every is not None:
            self.set_sample_every(self._pending_sample_every)
        coming = self.sampling
        if coming != bool(self._grad_hooks):  # the hooks on for a pair's steps, off after it
            self._hook_gradients(coming)
        return self._write_window() if len(self._rows_device) >= self.every else None

    def _add_row(self, squared_norms: torch.Tensor | None, loss: float | torch.Tensor | None, micro_batches: int, sizes: list[int],
                 precond_ok: bool) -> None:  # fmt: skip
        """The step's row: its device values (None when not sampled), and on the host the loss (a tensor's is kept, as a
        view, for the window's end), the micro-batches, the samples and their squares, whether the precond pair is in."""
        self._rows_device.append(squared_norms)
        tensor = isinstance(loss, torch.Tensor)
        if tensor:
            self._losses_device.append((len(self._rows_host), loss.detach().reshape(())))  # views: no kernel, no wait
        if len(sizes) == 1:  # one pass: the common plain step (this runs on every step, so it is kept short)
            samples = sizes[0]
            samples_sq = samples * samples
        else:
            samples, samples_sq = sum(sizes), sum([size * size for size in sizes])
        self._rows_host.append([
            0.0 if loss is None or tensor else float(loss), float(loss is not None), float(micro_batches),
            float(samples), float(samples_sq), float(precond_ok),
        ])  # fmt: skip

    def plain_step(self, loss: float | torch.Tensor | None) -> int | None:
        """step(loss) for the step that runs on nearly every call under sparse sampling, in one short function (in a
        training loop each function call and attribute read costs 5-10x what it costs timed alone, and this runs on
        every step): no statistics on this step or on the next (the hooks stay off), not the window's last step, a
        float loss, none, or a one-element tensor kept for the window's end (a GPU's: step() reads a CPU tensor now),
        the batch read by the forward hook. Returns the forward passes counted; None, having done nothing, for any
        other step, which step() takes."""
        steps, period, sizes = self.steps, self.sample_every, self._tally.forward_sizes
        if (period == 1 or steps % period < 2 or (steps + 1) % period < 2 or len(self._rows_host) + 2 > self.every
                or self._pending_sample_every is not None or self._closed or not self._hooks or not sizes
                or None in sizes):  # fmt: skip
            return None
        kept = loss is not None and type(loss) is not float
        if kept and (not isinstance(loss, torch.Tensor) or loss.numel() != 1 or (self._cpu_read_at_once if loss.is_cpu else not loss.is_cuda)):
            return None
        self._tally.forward_sizes = []
        self._add_row(None, loss, self.accumulation, sizes, False)
        self.steps = steps + 1
        return len(sizes)

    def _squared_norms(self, tally: _StepTally, micro_batches: int, divided: bool | None = None) -> tuple[torch.Tensor, bool]:
        """This rank's [sum over micro-batches of |g_b|^2, |g_B|^2, the same two of P g], true scale (see
        the module docstring for the loss and AMP factors), and whether the precond pair is there. divided: whether
        the hooks saw g_b / k (True for backward()'s halves); None: loss_divided_by_accumulation says."""
        scale = self._unscale()
        divided = self.loss_divided_by_accumulation if divided is None else divided
        micro_factor = (micro_batches**2 if divided else 1.0) / scale**2  # hooks saw scale * g_b / k (or scale * g_b)
        full_factor = 1.0 if divided else 1.0 / micro_batches**2  # .grad holds g_B (or k g_B), unscaled
        with_grad = [(i, p.grad) for i, p in enumerate(self.parameters) if p.grad is not None]
        micro_sq = self._sum_of_squares(tally.micro_norms) * micro_factor
        full_sq = self._sum_of_squares(self._norms([g for _, g in with_grad])) * full_factor
        adaptive = [(i, g) for i, g in with_grad if i in self._adaptive_groups]
        zero = torch.zeros((), device=self._device, dtype=self._dtype)
        if not adaptive or any(i not in tally.square_sums for i, _ in adaptive):
            return torch.stack([micro_sq, full_sq, zero, zero]), False
        true_scale = 1.0 if divided else 1.0 / micro_batches  # .grad holds g_B (or k g_B)
        denominators = preconditioner.coming_step_denominators(
            self.optimizer, [self.parameters[i] for i, _ in adaptive], [g * true_scale if true_scale != 1.0 else g for _, g in adaptive]
        )  # this step's 1 / P: its gradient folded into the optimizer's second moment, as optimizer.step() will fold it
        if any(d is None for d in denominators):  # the optimizer's first step: no second moment yet
            return torch.stack([micro_sq, full_sq, zero, zero]), False
        weights = [d.square_().reciprocal_() for d in denominators]  # P^2
        pre_micro = [(tally.square_sums[i] * w).sum(dtype=torch.float32) for (i, _), w in zip(adaptive, weights)]
        pre_full = [(g.float().square() * w).sum(dtype=torch.float32) for (_, g), w in zip(adaptive, weights)]
        return torch.stack([micro_sq, full_sq, self._sum(pre_micro) * micro_factor, self._sum(pre_full) * full_factor]), True

    def _sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The sum of float32 scalars, in the rows' dtype on the rows' device."""
        if self._one_device:
            return torch.stack(values).to(self._device, self._dtype).sum()
        return torch.stack([value.to(self._device, self._dtype) for value in values]).sum()

    def _norms(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Their float32 norms: one torch._foreach_norm call on one device (norms only, no copies), else one by one."""
        if self._one_device:
            return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]

    def _unsampled_sizes(self, sizes: list[int | None]) -> list[int]:
        """A step without statistics may run as any number of forward passes (one pass of the whole batch, say)."""
        if self.device_batch is not None:
            return [self.device_batch] * self.accumulation
        if None in sizes or not sizes:
            raise ValueError("a forward pass had no tensor argument to read its batch size from: pass device_batch=")
        return sizes

    def _micro_sizes(self, sizes: list[int | None], micro_batches: int) -> list[int]:
        if self.device_batch is not None:
            return [self.device_batch] * micro_batches
        if None in sizes:
            raise ValueError("a forward pass had no tensor argument to read its batch size from: pass device_batch=")
        if len(sizes) != micro_batches:
            raise ValueError(
                f"{len(sizes)} forward passes with gradients enabled for {micro_batches} backward passes since the last "
                "step: pass device_batch= (samples per micro-batch on one rank)"
            )
        return sizes

    def _unscale(self) -> float:
        """Unscales .grad in place (GradScaler remembers, its step() will not unscale again); returns the scale."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        try:
            scaler.unscale_(self.optimizer)
        except RuntimeError as error:  # the loop unscaled already (e.g. to clip)
            if "already been called" not in str(error):
                raise
        return float(scaler.get_scale())

    # -- once per window ---------------------------------------------------------------------------

    def _write_window(self) -> dict[str, Any] | None:
        """The window's rows (device values nan on the steps not sampled), summed over the ranks, as a record."""
        if self._losses_device:  # the tensor losses, in one copy from the device
            rows, losses = zip(*self._losses_device)
            alike = len({(loss.device, loss.dtype) for loss in losses}) == 1
            stacked = torch.stack(losses) if alike else torch.stack([loss.to(self._device, self._dtype) for loss in losses])
            for row, value in zip(rows, stacked.double().cpu().tolist()):
                self._rows_host[row][LOSS_SUM - DEVICE_COLUMNS] = value
            self._losses_device = []
        sampled = [i for i, row in enumerate(self._rows_device) if row is not None]
        if not sampled and self.world_size == 1:  # the common window under sparse sampling: its host rows as they are
            host, self._rows_device, self._rows_host = self._rows_host, [], []
            return self._finish_window(self._counts_record(host, DEVICE_COLUMNS))
        device = torch.stack([self._rows_device[i] for i in sampled]) if sampled else None
        if self.world_size > 1:  # one all-reduce of the whole window; every rank samples the same steps
            rows = torch.full((len(self._rows_host), DEVICE_COLUMNS), math.nan, device=self._device, dtype=self._dtype)
            if device is not None:
                rows[sampled] = device
            rows = torch.cat([rows, torch.tensor(self._rows_host, device=self._device, dtype=self._dtype)], dim=1)
            dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self.process_group)
            rows = rows.cpu().tolist()
        else:  # one process: the host values stay Python floats, one copy of the sampled rows from the device
            rows = [[math.nan] * DEVICE_COLUMNS + host for host in self._rows_host]
            for i, values in zip(sampled, device.cpu().tolist() if device is not None else []):
                rows[i][:DEVICE_COLUMNS] = values
        self._rows_device, self._rows_host = [], []
        return self._finish_window(self._record(rows) if sampled else self._counts_record(rows))

    def _finish_window(self, record: dict[str, Any] | None) -> dict[str, Any] | None:
        """The window's record with the stability measured in it, kept as last_record and written to the file."""
        self._metric = None
        if record is None:
            return None
        if self._stability is not None:
            record["stability_headroom"], record["stability_lr"] = self._stability
            self._stability = None
        self.last_record = record
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        return record

    def _counts_record(self, rows: list[list[float]], offset: int = 0) -> dict[str, Any] | None:
        """_record of a window in which no step took statistics (the common window under sparse sampling), without
        its per-row pass: the samples, the loss and the batch, or None where counts-only records are not wanted.
        offset: DEVICE_COLUMNS where the rows are the host columns alone (one process), 0 for whole rows."""
        samples_at, loss_at, count_at = SAMPLES - offset, LOSS_SUM - offset, LOSS_COUNT - offset
        samples = [round(row[samples_at]) for row in rows]
        self.samples += sum(samples)
        if rows and self.sample_every > 1:
            self._prev_norm = None  # the variability is step to step: no pair across a gap
        return self._counts_only(samples, [row[loss_at] / row[count_at] for row in rows if row[count_at] > 0])

    def _counts_only(self, samples: list[int], losses: list[float]) -> dict[str, Any] | None:
        """The record of a window whose steps gave no statistics (none sampled, or every sampled one left out):
        its counts, the most common batch and the mean loss; None where counts-only records are not wanted."""
        if not self.counts_only_records or not samples:
            return None
        batch = samples[0] if samples.count(samples[0]) == len(samples) else Counter(samples).most_common(1)[0][0]
        return {**dict.fromkeys(RECORD_KEYS), "samples": self.samples, "step": self.steps, "window_steps": 0, "metric": self._metric,
                "batch": batch, "loss": math.fsum(losses) / len(losses) if losses else None}  # fmt: skip

    def _record(self, rows: list[list[float]]) -> dict[str, Any] | None:
        """One record from a window's rows, summed over the ranks; None when no step gave statistics."""
        world = self.world_size
        steps: list[tuple[int, float, float, float, float, float, int]] = []
        variabilities, losses = [], []
        for row in rows:
            self.samples += round(row[SAMPLES])
            if row[LOSS_COUNT] > 0:
                losses.append(row[LOSS_SUM] / row[LOSS_COUNT])
            full_sq = row[FULL_SQ] / world  # identical on every rank: the mean is the value
            if not math.isfinite(full_sq):
                if self.sample_every > 1:
                    self._prev_norm = None  # the variability is step to step: no pair across a gap
                continue  # an AMP overflow (the scaler skips this step), or a step not sampled
            norm = math.sqrt(full_sq)
            if self._prev_norm:
                variabilities.append(abs(norm - self._prev_norm) / self._prev_norm)
            self._prev_norm = norm
            count, samples = row[MICRO_COUNT], row[SAMPLES]
            equal_micro_batches = count * row[SAMPLES_SQ] == samples * samples
            if equal_micro_batches and math.isfinite(row[MICRO_SQ]):
                precond = row[PRE_OK] == world and math.isfinite(row[PRE_MICRO_SQ] + row[PRE_FULL_SQ])
                steps.append((round(samples), samples / count, row[MICRO_SQ] / count, full_sq,
                              row[PRE_MICRO_SQ] / count if precond else math.nan, row[PRE_FULL_SQ] / world, self.samples))  # fmt: skip
        if not steps:
            return self._counts_only([round(row[SAMPLES]) for row in rows], losses)
        batch = Counter(s[0] for s in steps).most_common(1)[0][0]
        steps = [s for s in steps if s[0] == batch]
        micro_batch = round(steps[0][1])
        plain = [two_batch_estimates([s[2]], s[3], micro_batch, batch) for s in steps]
        precond = [two_batch_estimates([s[4]], s[5], micro_batch, batch) for s in steps if not math.isnan(s[4])]
        return {
            "samples": self.samples,
            "batch": batch,
            "grad_sqr": statistics.fmean(g for g, _ in plain),
            "trace_sigma": statistics.fmean(t for _, t in plain),
            "loss": statistics.fmean(losses) if losses else None,
            "metric": self._metric,
            "step": self.steps,
            "window_steps": len(steps),
            "variability": statistics.median(variabilities) if variabilities else None,
            "precond_grad_sqr": statistics.fmean(g for g, _ in precond) if precond else None,
            "precond_trace_sigma": statistics.fmean(t for _, t in precond) if precond else None,
            "statistics_samples": round(statistics.fmean(s[6] for s in steps)),
        }

    # -- LR stability ------------------------------------------------------------------------------

    def measure_stability(self, loss_fn: Any) -> dict[str, float] | None:
        """Measures the stability headroom (2 + 2 beta) / (eta lambda_max) now (profiler.sharpness) and puts the
        most restrictive since the last record (the smallest headroom x LR) into the next record as
        "stability_headroom" and "stability_lr". Call it between
        optimizer.step() and the next forward pass, every few hundred steps: it costs about 2 x 20 backward
        passes of loss_fn, which builds a loss on a fixed batch (under DDP, through the unwrapped module).
        Its forward pass leaves the training as it was: torch's random generators (dropout's masks) and the model's
        buffers (batch norm's running statistics) are restored after it.
        Needs the optimizer; returns the measurement, or None where no threshold is known for it."""
        if self.optimizer is None:
            raise ValueError("measure_stability needs the optimizer: its LR and momentum set the threshold")
        hooked, forward_sizes = bool(self._grad_hooks), list(self._tally.forward_sizes)
        self._hook_gradients(False)  # the measurement's own passes are not training steps
        try:
            with training_left_as_it_was(self._model_buffers, self._device):
                measured = stability_headroom(loss_fn, self.parameters, self.optimizer)
        finally:
            self._tally.forward_sizes = forward_sizes
            self._hook_gradients(hooked)
        if measured is not None:
            pair = (measured["stability_headroom"], measured["lr"])
            if self._stability is None or pair[0] * pair[1] < self._stability[0] * self._stability[1]:
                self._stability = pair
        return measured

    # -- the end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Writes the last, partial window (a collective under DDP: every rank calls close()), removes the hooks."""
        if self._closed:
            return
        try:
            if self._rows_device:
                self._write_window()
        finally:
            self._release()

    def _release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hook_gradients(False)
        if self._file is not None:
            self._file.close()
        self._closed = True

    def __enter__(self) -> GradientStatsLogger:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:  # no collective on the way out of an error: other ranks may be gone
            self._release()


def require_two_gradients(model: nn.Module, accumulation: int, how: str) -> None:
    """For a loop that cannot call GradientStatsLogger.backward (a trainer's callback): refuses, before training starts,
    one process without accumulation, with `how`, the trainer's own way to give the estimator two gradients a step."""
    if accumulation == 1 and _distributed_setup(model)[1] == 1:
        raise ValueError(f"{ONE_GRADIENT} {how}")


def _distributed_setup(model: nn.Module) -> tuple[Any, int, int]:
    """(process group, world size, rank): DDP's group, or one process."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        group = model.process_group
        return group, dist.get_world_size(group), dist.get_rank(group)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"torch.distributed runs {dist.get_world_size()} processes but the model is not a DistributedDataParallel: "
            "pass the DDP-wrapped model (the logger reads each rank's local gradient before DDP's all-reduce)"
        )
    return None, 1, 0


def _adaptive_groups(optimizer: torch.optim.Optimizer | None, parameters: list[nn.Parameter]) -> dict[int, dict]:
    """Parameter index -> its param group for an adaptive optimizer (Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, Adagrad,
    Adafactor: profiler.preconditioner); empty for other optimizers (no precond pair)."""
    if not preconditioner.is_adaptive(optimizer):
        return {}
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    return {index: group_of[id(p)] for index, p in enumerate(parameters) if id(p) in group_of}


def _unregister_empty_hook_dicts(parameters: list[nn.Parameter]) -> None:
    """Takes the emptied hook dict of each parameter out of autograd, where no other hook is left in it.

    Tensor.register_hook puts a dict of hooks on the tensor (Tensor._backward_hooks) and registers it with autograd
    once; removing a hook's handle empties the dict but leaves it registered, and every backward pass still calls
    into Python for it: 1.1-1.4 us per parameter tensor per backward pass on this repository's CPU tasks, on every plain
    step once the statistics' hooks came off (benchmarks/hook_residue.py, docs/validation/hook_residue.md: a 6-tensor
    MLP's pass 7 us slower, a 29-tensor ResNet's 41 us; a model of hundreds of tensors would pay hundreds of us).
    Assigning None to Tensor._backward_hooks clears the tensor's registered hook dict (torch's setter) and registers
    none. A parameter whose dict still holds someone else's hook keeps it, and the hook runs as before."""
    for parameter in parameters:
        hooks = parameter._backward_hooks
        if hooks is not None and not hooks:
            parameter._backward_hooks = None


def _leading_dim(args: tuple, kwargs: dict) -> int | None:
    """Dim 0 of the first tensor among a forward call's arguments (one level into lists and dicts)."""
    for value in [*args, *kwargs.values()]:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in inner:
            if isinstance(item, torch.Tensor) and item.dim() > 0:
                return int(item.shape[0])
    return None
