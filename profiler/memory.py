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


def cuda_memory(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's peaks since the last reset (None off CUDA)."""
    if device.type != "cuda":
        return None
    return {
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


def nvml_memory(device: torch.device) -> dict[str, int] | None:
    """The device's own total/used bytes via NVML: includes the CUDA context and communicators,
    which the allocator does not see. None off CUDA or when NVML is unavailable."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return {"total_bytes": int(info.total), "used_bytes": int(info.used)}
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # noqa: BLE001 - NVML is optional; say why it is missing
        return {"error": f"{type(error).__name__}: {error}"}


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmSize not found in /proc/self/status")


def apply_memory_limit(limit_bytes: int | None, device: torch.device) -> dict | None:
    """Emulate a device with `limit_bytes` of memory for the rest of this process.

    CUDA: `torch.cuda.set_per_process_memory_fraction`. CPU: RLIMIT_AS set to the address space in
    use now plus `limit_bytes`, so allocations beyond it genuinely fail (MemoryError / "can't
    allocate"). Call it after the model is built: weights then count outside the limit.
    """
    if not limit_bytes:
        return None
    limit_bytes = int(limit_bytes)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()  # the call refuses a bare "cuda"
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), index)
        return {"bytes": limit_bytes, "how": "torch.cuda.set_per_process_memory_fraction"}
    import resource

    in_use = _address_space_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = in_use + limit_bytes if hard == resource.RLIM_INFINITY else min(hard, in_use + limit_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return {"bytes": limit_bytes, "how": "RLIMIT_AS = address space in use + limit", "address_space_in_use_bytes": in_use}


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
