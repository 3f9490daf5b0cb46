"""PyTorch Lightning's link to a Tula run: `TulaRun` (profiler.tula_run) driven by a Trainer callback.

    tula = TulaLightningCallback("http://tula:8000", RUN_ID, every=20)
    trainer = L.Trainer(accumulate_grad_batches=2, callbacks=[tula]); trainer.fit(model, loader)
    tula.advice   # the latest GET /v1/runs/{id}/plan answer, or None

The advice is for the user to act on: the callback never changes the trainer's batch size, accumulation or
learning rate, and logs the advice nowhere (no Lightning logger, no progress bar).

Hooks, in the order Lightning 2.x calls them, and why each:
- on_fit_start: makes the TulaRun. Not `setup`: the strategy creates the optimizers and wraps the model in
  DistributedDataParallel after `setup`; on_fit_start runs after both, once per fit. accumulation is
  trainer.accumulate_grad_batches unless given; the optimizer is trainer.optimizers[0] (Adam/AdamW gives the
  preconditioned pair too); under 16-mixed the precision plugin's GradScaler is handed over, because the
  statistics' hooks see scaled gradients.
- on_train_batch_start: sets the statistics' step count to trainer.global_step, before the micro-batch's
  backward (so telemetry carries the trainer's step numbers, after a resume or a left-out step too). One
  process: shows each micro-batch to the statistics so they read its samples (dim 0 of its first tensor). Lightning calls training_step directly, not the module's forward, so the
  forward pre-hook GradientStatsLogger relies on would never fire. Under DDP the wrapper's forward does run
  once per micro-batch and the logger watches it itself.
- on_before_backward: keeps the micro-batch's loss. Lightning has divided it by accumulate_grad_batches
  already (so loss_divided_by_accumulation=True) and, under 16-mixed, multiplied it by the GradScaler's scale
  (divided out again at the step).
- on_after_backward: counts the step's backward passes.
- on_before_optimizer_step: `run.step(loss=...)`. Lightning calls it from the optimizer closure after the
  last micro-batch's backward (after DDP's all-reduce and the GradScaler's unscale_), and before gradient
  clipping and optimizer.step(): the statistics see the step's whole, unclipped gradient. The loss is the
  mean of the step's micro-batch losses (the training_step outputs), kept on the device until the window's end
  (no host synchronization a step, except under 16-mixed, where the scaler's scale is read). A step whose backward passes are not
  `accumulation` (an epoch's last, partial accumulation; a training_step that returned None) is left out of
  the telemetry and counted in `dropped_steps`.
- on_fit_end, teardown: close the run once (the last partial window, then the sender's flush).
  on_exception: one process closes the run; under DDP it does not, because closing is a collective and
  the other ranks may be gone (what the offline file holds stays there for `profiler.tula_run.upload`).

DDP: every rank makes a TulaRun and calls step() and close() (the statistics' all-reduce); only rank 0
sends telemetry, fetches advice and writes `offline_path`; `advice` is None on the other ranks.
Automatic optimization only; FSDP and DeepSpeed are not supported (see GradientStatsLogger).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from profiler.reference_logger import require_two_gradients
from profiler.tula_run import TulaRun


class TulaLightningCallback(pl.Callback):
    """See the module docstring. server: the Tula service's URL, or None with offline_path. run_id: from POST
    /v1/runs. accumulation: micro-batches per optimizer step (default trainer.accumulate_grad_batches).
    flush_timeout_s: how long closing waits for the last records to be sent. The rest are TulaRun's."""

    def __init__(
        self,
        server: str | None,
        run_id: str,
        *,
        every: int = 20,
        accumulation: int | None = None,
        device_batch: int | None = None,
        token: str | None = None,
        offline_path: str | Path | None = None,
        timeout_s: float = 2.0,
        plan_every_s: float = 30.0,
        sample_every: int = 1,
        post_every_s: float = 1.0,
        overhead_budget: float | None = None,
        flush_timeout_s: float = 10.0,
    ):
        self.server, self.run_id, self.accumulation, self.flush_timeout_s = server, run_id, accumulation, flush_timeout_s
        self.options = {"every": every, "device_batch": device_batch, "token": token, "offline_path": offline_path,
                        "timeout_s": timeout_s, "plan_every_s": plan_every_s, "sample_every": sample_every,
                        "post_every_s": post_every_s, "overhead_budget": overhead_budget}  # fmt: skip
        self.run: TulaRun | None = None
        self.dropped_steps = 0
        self.closed = False
        self._batches: _MicroBatches | None = None
        self._backward_passes = 0
        self._losses: list[torch.Tensor] = []

    @property
    def advice(self) -> dict[str, Any] | None:
        """The latest advice the run fetched (GET /v1/runs/{id}/plan), or None."""
        return None if self.run is None else self.run.advice

    # -- start ------------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("TulaLightningCallback needs automatic optimization: with manual optimization use profiler.tula_run.TulaRun in training_step")
        model, accumulation = self._statistics_model(trainer, pl_module), self.accumulation or trainer.accumulate_grad_batches
        require_two_gradients(model, accumulation, "Train with Trainer(accumulate_grad_batches=2) or more, or on several devices (DDP)")
        self.run = TulaRun(self.server, self.run_id, model, trainer.optimizers[0], accumulation=accumulation, loss_divided_by_accumulation=True,
                           grad_scaler=_grad_scaler(trainer), **self.options)  # fmt: skip
        self.dropped_steps, self._backward_passes, self._losses, self.closed = 0, 0, [], False

    def _statistics_model(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> nn.Module:
        """The DDP wrapper (its forward runs once per micro-batch, and it names the process group), else a
        module over the LightningModule's parameters whose forward on_train_batch_start calls."""
        if isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel):
            self._batches = None
            return trainer.strategy.model
        self._batches = _MicroBatches(pl_module)
        return self._batches

    # -- every micro-batch ------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.run is None:
            return
        self.run.logger.steps = trainer.global_step  # before the backward passes: records carry the trainer's step numbers
        if self._batches is not None:
            with torch.enable_grad():
                self._batches(batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._backward_passes += 1

    # -- every optimizer step ---------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        if self.run is None:
            return
        backward_passes, losses = self._backward_passes, self._losses
        self._backward_passes, self._losses = 0, []
        if backward_passes != self.run.accumulation:
            self._drop_step()
            return
        self.run.step(loss=_step_loss(losses, trainer))

    def _drop_step(self) -> None:
        """GradientStatsLogger refuses a step whose backward passes are not `accumulation` and forgets what its
        hooks saw of it (RuntimeError for none, ValueError otherwise), so the next step starts clean."""
        try:
            self.run.step()
        except (RuntimeError, ValueError):
            self.dropped_steps += 1

    # -- the end ----------------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.run is not None and self.run.logger.world_size == 1:
            self._close()

    def _close(self) -> None:
        """Once per fit: a normal end calls both on_fit_end and teardown."""
        if self.run is not None and not self.closed:
            self.closed = True
            self.run.close(flush_timeout_s=self.flush_timeout_s)


class _MicroBatches(nn.Module):
    """The LightningModule's parameters, and a forward that only receives a training batch: calling it runs
    GradientStatsLogger's forward pre-hook, which reads the micro-batch's samples. Never part of training."""

    def __init__(self, pl_module: pl.LightningModule):
        super().__init__()
        self.pl_module = pl_module

    def forward(self, batch: Any) -> None:
        return None


def _grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """16-mixed's GradScaler (None for 32, bf16-mixed and other plugins)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def _step_loss(losses: list[torch.Tensor], trainer: pl.Trainer) -> torch.Tensor | None:
    """The mean of the step's micro-batch losses: each came divided by accumulate_grad_batches (and times the
    GradScaler's scale under 16-mixed, unchanged until the scaler's update() after optimizer.step()). A tensor
    on the device, which the logger reads at its window's end: a float here would wait for the GPU before
    every optimizer step."""
    if not losses:
        return None
    total = torch.stack(losses).sum()
    scaler = _grad_scaler(trainer)
    if scaler is not None and scaler.is_enabled():
        total = total / scaler.get_scale()
    return total.detach()
