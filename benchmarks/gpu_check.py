"""The profiler's measurements on a CUDA device, in one short run (under 8 minutes on one GPU).

Runs benchmarks/profile_fidelity.py's measurements on CUDA (fp32, then bf16 autocast with
channels-last), then an out-of-memory probe under a per-process memory fraction. Prints the same
summary line as profile_fidelity. Without CUDA it says so and exits 0.

Run: .venv/bin/python benchmarks/gpu_check.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_fidelity  # noqa: E402

from tula_service.units import GIB  # noqa: E402


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    started = time.perf_counter()
    results = []
    for extra in ({"dtype": "fp32", "channels_last": False}, {"dtype": "bf16", "channels_last": True}):
        print(f"\n== {extra}")
        for name, workload in profile_fidelity.WORKLOADS.items():
            results.append(
                profile_fidelity.profile_model(name, workload, profile_fidelity.BATCHES["cuda"], "cuda", 5.0, extra)
            )
    oom = profile_fidelity.run_point(
        {**profile_fidelity.WORKLOADS["resnet18"], "batch_size": 4096, "device": "cuda", "time_cap_s": 1.0,
         "memory_limit_bytes": 2 * GIB}  # fmt: skip
    )
    print(f"\nresnet18 batch 4096 under a 2 GiB limit: {oom['status']} {oom.get('error', '')[:120]}")
    print(profile_fidelity.summary_line(results, time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
