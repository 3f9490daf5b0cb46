"""How far can the profiler's numbers be trusted on this machine?

For three zoo models, profile a few batch sizes exactly as the service does (one child process per
point) and print per point: median iteration time, CV and robust CV of the timing samples, how many
samples and why sampling stopped; per model: the linearity (R^2) of activation and peak memory in
the batch size and the seconds the whole profile took. The last line is the summary:

    profile_fidelity: models=N max_cv_pct=X min_mem_r2=Y seconds=Z

Run: .venv/bin/python benchmarks/profile_fidelity.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

import numpy as np

from tula_service.spec.job_spec import Precision

IMAGES_32 = {"name": "synthetic_images", "num_samples": 50_000, "channels": 3, "image_size": 32, "num_classes": 10}
TOKENS = {"name": "synthetic_tokens", "num_samples": 10_000, "seq_len": 64, "vocab_size": 256}

WORKLOADS = {
    "small_cnn": {"model": "small_cnn", "dataset": IMAGES_32},
    "resnet18": {"model": "resnet18", "dataset": IMAGES_32},
    "gpt": {"model": "gpt", "model_options": {"layers": 2, "width": 128, "heads": 4}, "dataset": TOKENS},
}
BATCHES = {"cpu": [4, 8, 16, 32, 64], "cuda": [32, 64, 128, 256, 512]}
QUICK_BATCHES = {"cpu": [4, 8, 16], "cuda": [32, 64, 128]}


def run_point(request: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "m.json"
        subprocess.run(
            [sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
            check=True,
        )
        return json.loads(out.read_text())


def r_squared(x: np.ndarray, y: np.ndarray) -> float:
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = np.sum((y - y.mean()) ** 2)
    return float(1 - np.sum(residual**2) / total) if total > 0 else 1.0


def profile_model(name: str, workload: dict, batches: list[int], device: str, time_cap_s: float, extra: dict) -> dict:
    started = time.perf_counter()
    points = []
    for batch in batches:
        request = {**workload, "batch_size": batch, "device": device, "time_cap_s": time_cap_s, "grad_iters": 4, **extra}
        points.append(run_point(request))
    seconds = time.perf_counter() - started
    ok = [p for p in points if p["status"] == "ok"]
    x = np.array([p["batch_size"] for p in ok], dtype=float)
    act_r2 = r_squared(x, np.array([p["memory"]["activation_bytes"] for p in ok], dtype=float))
    peak_r2 = r_squared(x, np.array([p["memory"]["peak_bytes"] for p in ok], dtype=float))
    print(f"\n{name} on {device} ({seconds:.1f} s; activation R^2 {act_r2:.6f}, peak R^2 {peak_r2:.6f})")
    print(f"{'batch':>6} {'median ms':>10} {'cv %':>6} {'rcv %':>6} {'n':>5} {'stopped by':>10} {'act MiB':>9} {'B_noise':>9}")
    for p in points:
        if p["status"] != "ok":
            print(f"{p['batch_size']:>6} {p['status']}")
            continue
        t, g = p["iter_time"], p["gradient"] or {}
        noise = g.get("noise_scale")
        print(
            f"{p['batch_size']:>6} {t['median_s'] * 1e3:>10.2f} {t['cv'] * 100:>6.1f} {t['robust_cv'] * 100:>6.1f}"
            f" {t['count']:>5} {t['stopped_by']:>10} {p['memory']['activation_bytes'] / 2**20:>9.2f}"
            f" {noise if noise is None else round(noise, 1)!s:>9}"
        )
    return {
        "max_cv": max(p["iter_time"]["cv"] for p in ok),
        "min_r2": min(act_r2, peak_r2),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three batch sizes, 1 s time cap per point")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=get_args(Precision))
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args(argv)
    batches = (QUICK_BATCHES if args.quick else BATCHES)[args.device]
    time_cap_s = 1.0 if args.quick else 5.0
    extra = {"dtype": args.dtype, "channels_last": args.channels_last}
    started = time.perf_counter()
    results = [profile_model(name, w, batches, args.device, time_cap_s, extra) for name, w in WORKLOADS.items()]
    print(summary_line(results, time.perf_counter() - started))
    return 0


def summary_line(results: list[dict], seconds: float) -> str:
    return (
        f"profile_fidelity: models={len(results)} max_cv_pct={max(r['max_cv'] for r in results) * 100:.1f}"
        f" min_mem_r2={min(r['min_r2'] for r in results):.6f} seconds={seconds:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
