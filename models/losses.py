"""The training loss of a workload: a catalog name (models.registry.LOSSES) or the user's own function.

Every loss here is a mean over the batch's samples (and over a sample's outputs or positions, all samples having
the same number): profiler.gradstats and the pilot split a batch into micro-batches and average their losses, and
the two-batch noise estimator takes g_B as the mean of the halves' gradients. A loss summed over the batch would
scale |g_B| with B and read the noise scale wrong; models.user_contract checks a user loss for it.

- cross_entropy: (1/B) sum_i -log softmax(z_i)[y_i], y_i an int64 class index; on token data (logits (B, T, V),
  targets (B, T)) the mean over the B x T positions (next-token prediction).
- mse: (1/(B k)) sum_i |z_i - y_i|^2 over outputs z_i and float targets y_i of the same shape (B, k).
- l1: (1/(B k)) sum_i |z_i - y_i|_1, same shapes.
- bce_with_logits: (1/(B k)) sum_ij -[y_ij log s(z_ij) + (1 - y_ij) log(1 - s(z_ij))], s the logistic sigmoid,
  targets in [0, 1] (multi-label classification); torch's numerically stable form.
- "package.module:function" (allowlisted as user models are): called as function(outputs, targets), whatever
  the model returns as outputs, and returns the batch's mean loss as a scalar tensor.

The shapes are the dataset contract's (models.user_contract.batch_problem): no broadcasting, so a model giving
(B, 1) against targets (B,) is refused at submission instead of training on a (B, B) difference.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from models.registry import DEFAULT_LOSS, LOSSES, is_user_ref, unknown_name_message

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch: (1/B) sum_i -log softmax(logits_i)[y_i]."""
    return F.cross_entropy(logits, labels)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B * T tokens of logits (B, T, V) against targets (B, T). Every sequence
    has T tokens, so the mean over a split batch is the mean of its parts' means (the noise estimator's need)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def mean_squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(1/(B k)) sum_i |z_i - y_i|^2, outputs and targets of one shape (B, k)."""
    return F.mse_loss(outputs, targets)


def mean_absolute_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(1/(B k)) sum_i |z_i - y_i|_1, outputs and targets of one shape (B, k)."""
    return F.l1_loss(outputs, targets)


def multi_label_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each logit against its target in [0, 1], averaged over the B x k outputs."""
    return F.binary_cross_entropy_with_logits(logits, targets)


_BY_NAME: dict[str, LossFn] = {"mse": mean_squared_error, "l1": mean_absolute_error, "bce_with_logits": multi_label_loss}
assert set(_BY_NAME) | {DEFAULT_LOSS} == set(LOSSES), "models.registry.LOSSES and models.losses name the same losses"


def takes_labels(loss: str | None) -> bool:
    """Whether the loss takes int64 class indices (cross-entropy), as catalog datasets give them."""
    return loss is None or loss == DEFAULT_LOSS


def loss_function(loss: str | None, input_kind: str, allowed_modules: list[str] | None = None) -> LossFn:
    """The loss a workload trains with: None or "cross_entropy" is cross-entropy (next-token on "tokens" data), a
    catalog name its function, "package.module:function" the user's (imported only when allowlisted)."""
    if takes_labels(loss):
        return next_token_loss if input_kind == "tokens" else classification_loss
    if is_user_ref(loss):
        from models.user_contract import import_user_factory  # user code is imported only when asked for

        return import_user_factory(loss, list(allowed_modules or []), "loss")
    if loss not in _BY_NAME:
        raise KeyError(unknown_name_message("loss", loss, LOSSES))
    return _BY_NAME[loss]
