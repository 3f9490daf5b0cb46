"""The Hugging Face Trainer's link to a Tula run: `TulaRun` (profiler.tula_run) driven by a TrainerCallback.

    tula = TulaTrainerCallback("http://tula:8000", RUN_ID, every=20)
    trainer = Trainer(model, TrainingArguments(..., gradient_accumulation_steps=2), callbacks=[tula]); trainer.train()
    tula.advice   # the latest GET /v1/runs/{id}/plan answer, or None

The advice is for the user to act on: the callback never changes the batch size, accumulation or learning
rate, never touches TrainerControl, and logs the advice nowhere.

Hooks, in the order the Trainer (transformers 4.48.1 to 5.x) calls them, and why each:
- on_train_begin: makes the TulaRun. The Trainer calls it after it has created and prepared the optimizer,
  so kwargs["optimizer"] exists (accelerate's AcceleratedOptimizer: the statistics get the torch optimizer
  inside it, so that Adam/AdamW gives the preconditioned pair, and its GradScaler under fp16).
  kwargs["model"] is the unwrapped model; under DDP pass `trainer=` so the statistics get the
  DistributedDataParallel wrapper (trainer.model_wrapped). accumulation is args.gradient_accumulation_steps
  unless given.
- on_step_begin: sets the statistics' step count to state.global_step, before the step's backward passes
  (so telemetry carries the Trainer's step numbers, after a resume or a left-out step too).
- on_substep_end: counts the micro-batches of the step but its last (the Trainer calls it after each of
  their backward passes).
- on_log: keeps the last logged training loss.
- on_pre_optimizer_step: `run.step(loss=...)`. The Trainer calls it after the last micro-batch's backward
  (and DDP's all-reduce), after gradient clipping and before optimizer.step(). The loss is the latest
  logged training loss not passed yet, else None (the Trainer's per-step loss is not handed to callbacks).
  A step whose micro-batches are not `accumulation` (an epoch's last, partial accumulation) is left out of
  the telemetry and counted in `dropped_steps`.
- on_train_end: closes the run (the last partial window, then the sender's flush). The Trainer has no hook
  for an exception: then the run is not closed (its sender thread is a daemon; records already written to
  `offline_path` stay there for `profiler.tula_run.upload`).

Gradient clipping (args.max_grad_norm, 1.0 by default). The Trainer clips `.grad` before
on_pre_optimizer_step and does not hand callbacks the norm before clipping, while the statistics' hooks saw
the micro-batch gradients unclipped: a clipped step's |g_B|^2 would not match them. So a step whose `.grad`
norm reached max_grad_norm (one norm over the gradients per step, a host synchronization) is left out of the
statistics, as GradientStatsLogger leaves out an AMP overflow step (its samples and loss still count), and
counted in `clipped_steps`. A window whose every step was clipped sends no record. To measure through
clipping, raise max_grad_norm, or set it to 0 and clip in a callback listed after this one (its
on_pre_optimizer_step runs after this one's).

Loss scaling (`loss_divided_by_accumulation`; None means True, with a warning in the one case below that
cannot be told from outside). What reaches backward() must be each micro-batch's mean loss divided by the
step's micro-batches, or the same thing spelled differently; the Trainer gets there in two ways:
- it divides the loss by the micro-batches itself (when the model does not accept loss kwargs, or the
  batch has no "labels");
- it does not divide, and passes `num_items_in_batch` (the labels in all the step's micro-batches) to a
  model whose forward takes **kwargs (or says `accepts_loss_kwargs`), relying on the model's loss being
  the sum over its labels divided by num_items_in_batch: the same division for micro-batches of equal size
  (Transformers' own models do this).
Pass False when the loss reaching backward() is a per-micro-batch mean nothing divided: a custom model whose
forward takes **kwargs but ignores num_items_in_batch (the callback warns about a non-Transformers model
that takes **kwargs), a compute_loss_func or `loss_is_scaled_for_ga=True` returning a plain mean. A wrong
setting scales |G|^2 and tr(Sigma) by accumulation^2 alike (their ratio, B_simple, is unchanged).
Transformers 4.46.0 to 4.48.0 got this wrong themselves (4.47 never divided, 4.48.0 withheld
num_items_in_batch from the models that take it), hence the extra's transformers>=4.48.1.

DDP: every rank makes a TulaRun and calls step() and close() (the statistics' all-reduce); only rank 0
sends telemetry, fetches advice and writes `offline_path`; `advice` is None on the other ranks. FSDP and
DeepSpeed are not supported (see GradientStatsLogger).
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from profiler.reference_logger import require_two_gradients
from profiler.tula_run import TulaRun

CLIPPED_SHARE = 1e-3  # a step whose gradient norm is within this share of max_grad_norm counts as clipped


class TulaTrainerCallback(TrainerCallback):
    """See the module docstring. server: the Tula service's URL, or None with offline_path. run_id: from POST
    /v1/runs. accumulation: micro-batches per optimizer step (default args.gradient_accumulation_steps).
    trainer: needed under DDP only. flush_timeout_s: how long closing waits for the last records to be sent.
    The rest are TulaRun's."""

    def __init__(
        self,
        server: str | None,
        run_id: str,
        *,
        every: int = 20,
        accumulation: int | None = None,
        device_batch: int | None = None,
        loss_divided_by_accumulation: bool | None = None,
        token: str | None = None,
        offline_path: str | Path | None = None,
        timeout_s: float = 2.0,
        plan_every_s: float = 30.0,
        sample_every: int = 1,
        post_every_s: float = 1.0,
        overhead_budget: float | None = None,
        flush_timeout_s: float = 10.0,
        trainer: Any = None,
    ):
        self.server, self.run_id, self.accumulation, self.flush_timeout_s, self.trainer = server, run_id, accumulation, flush_timeout_s, trainer
        self.loss_divided_by_accumulation = loss_divided_by_accumulation
        self.options = {"every": every, "device_batch": device_batch, "token": token, "offline_path": offline_path,
                        "timeout_s": timeout_s, "plan_every_s": plan_every_s, "sample_every": sample_every,
                        "post_every_s": post_every_s, "overhead_budget": overhead_budget}  # fmt: skip
        self.run: TulaRun | None = None
        self.dropped_steps = self.clipped_steps = 0
        self.closed = False
        self._scale: _TrainerGradientScale | None = None
        self._parameters: list[nn.Parameter] = []
        self._substeps = 0
        self._logged_loss: float | None = None

    @property
    def advice(self) -> dict[str, Any] | None:
        """The latest advice the run fetched (GET /v1/runs/{id}/plan), or None."""
        return None if self.run is None else self.run.advice

    # -- start ------------------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module = None, optimizer: Any = None, **kwargs) -> None:
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's AcceleratedOptimizer
        self._scale = _TrainerGradientScale.of(getattr(optimizer, "scaler", None), args.max_grad_norm)
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        wrapped, accumulation = self._statistics_model(model), self.accumulation or args.gradient_accumulation_steps
        require_two_gradients(wrapped, accumulation, "Train with TrainingArguments(gradient_accumulation_steps=2) or more, or on several devices (DDP)")
        self.run = TulaRun(self.server, self.run_id, wrapped, torch_optimizer, accumulation=accumulation,
                           loss_divided_by_accumulation=self._loss_divided(model), grad_scaler=self._scale, **self.options)  # fmt: skip
        self.dropped_steps = self.clipped_steps = self._substeps = 0
        self.closed, self._logged_loss = False, None

    def _statistics_model(self, model: nn.Module) -> nn.Module:
        """The model, or under DDP the DistributedDataParallel wrapper the Trainer keeps (callbacks get the unwrapped model)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return model
        wrapped = getattr(self.trainer, "model_wrapped", None)
        if not isinstance(wrapped, nn.parallel.DistributedDataParallel):
            raise ValueError("under DDP pass trainer= to TulaTrainerCallback: the statistics need the DistributedDataParallel model (trainer.model_wrapped)")
        return wrapped

    def _loss_divided(self, model: nn.Module) -> bool:
        if self.loss_divided_by_accumulation is not None:
            return self.loss_divided_by_accumulation
        if _accepts_loss_kwargs(model) and not isinstance(model, PreTrainedModel):
            warnings.warn(
                f"{type(model).__name__}.forward takes **kwargs, so the Trainer passes num_items_in_batch and does not divide the loss by "
                "gradient_accumulation_steps: if the model's loss ignores num_items_in_batch, pass loss_divided_by_accumulation=False to "
                "TulaTrainerCallback (or set accepts_loss_kwargs = False on the model)", stacklevel=2)  # fmt: skip
        return True

    # -- every step's start, every micro-batch, every log -------------------------------------------------------------------

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.run is not None:
            self.run.logger.steps = state.global_step  # before the backward passes: records carry the Trainer's step numbers

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self._substeps += 1

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, float] | None = None, **kwargs) -> None:
        if logs and "loss" in logs:
            self._logged_loss = float(logs["loss"])

    # -- every optimizer step ---------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.run is None or self.closed:
            return
        micro_batches, self._substeps = self._substeps + 1, 0
        loss, self._logged_loss = self._logged_loss, None
        if micro_batches != self.run.accumulation:
            self._drop_step()
            return
        if self._scale is not None:
            self._scale.clipped = self._scale.max_grad_norm > 0 and _grad_norm(self._parameters) >= self._scale.max_grad_norm * (1 - CLIPPED_SHARE)
            self.clipped_steps += self._scale.clipped
        self.run.step(loss=loss)

    def _drop_step(self) -> None:
        """GradientStatsLogger refuses a step whose backward passes are not `accumulation` and forgets what its
        hooks saw of it (ValueError), so the next step starts clean."""
        try:
            self.run.step()
        except (RuntimeError, ValueError):
            self.dropped_steps += 1

    # -- the end ----------------------------------------------------------------------------------------

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.run is not None and not self.closed:
            self.closed = True
            self.run.close(flush_timeout_s=self.flush_timeout_s)


class _TrainerGradientScale:
    """GradientStatsLogger's grad_scaler protocol (is_enabled, unscale_, get_scale): the factor between the
    micro-batch gradients the logger's hooks saw and `.grad` at on_pre_optimizer_step.
    - fp16: accelerate's GradScaler. The hooks saw scaled gradients; `.grad` was unscaled before this hook
      (accelerate's clip_grad_norm_, which 5.x runs even with max_grad_norm=0 to measure the norm; where it
      did not run, the logger's unscale_ does it, and the optimizer's step does not unscale twice).
    - a clipped step (`clipped`, set by the callback before each step): `.grad` is the gradient times a
      factor the Trainer does not hand over, so get_scale() is NaN and the logger leaves the step's
      statistics out, as it does an AMP overflow step's."""

    def __init__(self, amp_scaler: Any, max_grad_norm: float):
        self.amp_scaler, self.max_grad_norm, self.clipped = amp_scaler, max_grad_norm, False

    @classmethod
    def of(cls, amp_scaler: Any, max_grad_norm: float | None) -> _TrainerGradientScale | None:
        """None when there is neither an enabled GradScaler nor clipping."""
        amp = amp_scaler if amp_scaler is not None and amp_scaler.is_enabled() else None
        max_norm = float(max_grad_norm or 0.0)
        return cls(amp, max_norm) if amp is not None or max_norm > 0 else None

    def is_enabled(self) -> bool:
        return True

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.amp_scaler is not None:
            self.amp_scaler.unscale_(optimizer)

    def get_scale(self) -> float:
        if self.clipped:
            return math.nan
        return float(self.amp_scaler.get_scale()) if self.amp_scaler is not None else 1.0


def _grad_norm(parameters: list[nn.Parameter]) -> float:
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in parameters if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """The Trainer's rule: the model's `accepts_loss_kwargs`, else whether its forward takes **kwargs."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
