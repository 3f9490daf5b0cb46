"""Memory accounting for one training iteration.

Peak training memory is modelled as `M(b) = M_static + m_act * b` (Tula seed paper, Fig. 4):
static = weights + gradients + optimizer state; activations = what autograd saves for backward.

- CUDA: the allocator's own peak (`torch.cuda.max_memory_allocated`) is the measurement.
- CPU: there is no allocator peak to read, so activations are the bytes of every tensor saved for
  backward during one forward pass, counted once per storage through
  `torch.autograd.graph.saved_tensors_hooks`; parameters saved by layers (e.g. conv weights) are
  excluded because they are already part of the static bytes.
"""

from __future__ import annotations

import torch
from torch import nn


def tensor_storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def static_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Weights, gradients and optimizer state in bytes (after at least one optimizer step)."""
    weights = sum(tensor_storage_bytes(p) for p in model.parameters())
    gradients = sum(tensor_storage_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer_state = sum(
        tensor_storage_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
    return {"weights": weights, "gradients": gradients, "optimizer_state": optimizer_state}


class SavedActivationCounter:
    """Counts bytes saved for backward, de-duplicated by storage, excluding parameter storages."""

    def __init__(self, model: nn.Module):
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._param_storages and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
