"""The profiler and the online benchmark on a CUDA device, in one short run (under 8 minutes on one GPU).

1. The profiler: benchmarks/profile_fidelity.py's measurements on CUDA at its quick batches (fp32, then bf16
   autocast with channels-last), then an out-of-memory probe under a per-process memory fraction (a point that
   runs out of memory is data: status "oom", not a crash). A model whose points fail is reported and the
   check goes on.
2. Issue 17 on a GPU: benchmarks/online.py --device cuda (the server profiles on the GPU, the runs train there,
   the real client sends telemetry to the real server) with --seeds seeds, its report in OUT/online.
3. The client's own cost per step on the GPU: benchmarks/client_overhead.py --device cuda over CLIENT_ROUNDS rounds,
   its report in OUT/client_overhead (the fixed cost every step pays, the budget's client, in microseconds, and the
   cost per call second that the overhead budget assumes from the CPU: profiler.tula_run.COST_PER_CALL_SECOND).

Without CUDA it says so and exits 0. Last line:
`gpu_check: profiled_models=N/M max_cv_pct=X min_mem_r2=Y oom_probe=STATUS online_tasks=K time_ratio_vs_static=R overhead_pct=P
client_fixed_us=F client_overhead_pct=C client_cost_per_call=K`

Run: .venv/bin/python benchmarks/gpu_check.py [--out DIR] [--seeds N] [--tasks NAME ...] [--oom-probe-only]
     --out: where online.md/json and gpu_check.json go (default: a temporary folder, never tracked files).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client_overhead  # noqa: E402
import online  # noqa: E402
import profile_fidelity  # noqa: E402

from tula_service.units import GIB  # noqa: E402

PRECISIONS = ({"dtype": "fp32", "channels_last": False}, {"dtype": "bf16", "channels_last": True})
POINT_TIME_CAP_S = 1.0
CLIENT_ROUNDS = 16  # about 30 s on the three tasks' 1-2 ms GPU steps
OOM_PROBE = {**profile_fidelity.WORKLOADS["resnet18"], "batch_size": 4096, "device": "cuda", "time_cap_s": 1.0, "memory_limit_bytes": 2 * GIB}


def profiler_check(fidelity_too: bool = True) -> dict:
    """Each zoo workload at the quick CUDA batches in each precision (unless fidelity_too is false); the OOM probe."""
    fidelity = []
    for extra in PRECISIONS if fidelity_too else ():
        print(f"\n== profiler on cuda, {extra}", flush=True)
        for name, workload in profile_fidelity.WORKLOADS.items():
            try:
                result = profile_fidelity.profile_model(name, workload, profile_fidelity.QUICK_BATCHES["cuda"], "cuda", POINT_TIME_CAP_S, extra)
                fidelity.append({"model": name, **extra, **result})
            except Exception:  # a failing model is a finding, not the end of the check
                print(f"{name} {extra}: FAILED\n{traceback.format_exc()}", flush=True)
                fidelity.append({"model": name, **extra, "failed": traceback.format_exc(limit=3)})
    oom = profile_fidelity.run_point(OOM_PROBE)
    print(f"\nresnet18 batch 4096 under a 2 GiB limit: {oom['status']} {str(oom.get('error', ''))[:160]}", flush=True)
    return {"fidelity": fidelity, "oom_probe": {"status": oom["status"], "error": str(oom.get("error", ""))[:500]}}


def summary_line(profiled: dict, online_summary: str, client_summary: str = "") -> str:
    ok = [r for r in profiled["fidelity"] if "failed" not in r]
    cv = f"{100 * max(r['max_cv'] for r in ok):.1f}" if ok else "n/a"
    r2 = f"{min(r['min_r2'] for r in ok):.6f}" if ok else "n/a"
    tail = online_summary.removeprefix("online: ").replace("tasks=", "online_tasks=")
    client = dict(pair.split("=") for pair in client_summary.removeprefix("client_overhead: ").split() if "=" in pair)
    client_tail = (f" client_fixed_us={client['fixed_us']} client_overhead_pct={client['overhead_pct']} "
                   f"client_cost_per_call={client['cost_per_call']}") if client else ""  # fmt: skip
    return (f"gpu_check: profiled_models={len(ok)}/{len(profiled['fidelity'])} max_cv_pct={cv} min_mem_r2={r2} "
            f"oom_probe={profiled['oom_probe']['status']} {tail}{client_tail}")


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seeds", type=int, default=online.QUICK_SEEDS)
    parser.add_argument("--tasks", nargs="+", default=list(online.DEFAULT_TASKS))
    parser.add_argument("--oom-probe-only", action="store_true", help="of the profiler's checks, only the out-of-memory probe (a rerun)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure")
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="tula-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    started = time.perf_counter()
    profiled = profiler_check(fidelity_too=not args.oom_probe_only)
    profiled["seconds"] = time.perf_counter() - started
    (out / "gpu_check.json").write_text(json.dumps(profiled, indent=1))
    print(f"\nprofiler check: {profiled['seconds']:.0f} s", flush=True)
    online_args = ["--device", "cuda", "--seeds", str(args.seeds), "--out", str(out / "online"), "--tasks", *args.tasks]
    online.main(online_args)
    results = json.loads((out / "online" / "online.json").read_text())["results"]
    print("\n== the client's own cost on cuda", flush=True)
    client_rows = [client_overhead.summarize(client_overhead.measure(name, CLIENT_ROUNDS, "cuda")) for name in args.tasks]
    (out / "client_overhead").mkdir(exist_ok=True)
    (out / "client_overhead" / "client_overhead.md").write_text(client_overhead.markdown(client_rows, CLIENT_ROUNDS))
    print(summary_line(profiled, online.summary_line(results), client_overhead.summary_line(client_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
