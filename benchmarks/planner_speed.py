"""How long does planning take over a large search space?

Times `tula_service.plan.planner.sweep` followed by `choose` (objective "knee") over 64 per-device batch
sizes x 64 device counts (1..64, every count, not only powers of two) on every placement the planner sweeps
over the 8 nodes x 8 GPUs (packed, spread, and even over 2 and 4 nodes: 145 placements of the 64 counts)
x 8 accumulation options (1..8): 74,240 configurations, from performance models fitted the way `recommend.plan` fits them
(`tula_service.fit.fitting.fit_models`) on hand-made measurements with known lines
(`benchmarks/handmade_measurements.py`, noise scale 2048). Also timed, for reference: `sweep` and
`choose` alone, `fit_models`, and the whole `recommend.plan` (fitting, sweep, choice, one
provenance-labelled row per candidate), once over its own search space (powers-of-two device counts,
accumulation 1/2/4/8) and once over the same 64 x 64 x 8 space; `plan` takes no search-space argument, so for that run its `PlanInputs` gets the
explicit device counts and accumulation options inside this process (nothing is edited on disk).

Each is run 30 times (--repeats) after WARMUP untimed runs; median and p90 in milliseconds. The last line:

    planner_speed: configs=N median_ms=X       (sweep + choose; target < 50 ms)

Run: .venv/bin/python benchmarks/planner_speed.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from handmade_measurements import measurement, spec_dict  # noqa: E402

from tula_service.fit.fitting import fit_models  # noqa: E402
from tula_service.measurement import parse_measurement  # noqa: E402
from tula_service.plan import recommend  # noqa: E402
from tula_service.plan.planner import PlanInputs, choose, placements, sweep  # noqa: E402
from tula_service.spec.job_spec import JobSpec  # noqa: E402
from tula_service.units import GIB  # noqa: E402

DEVICE_BATCHES = np.arange(8, 8 * 65, 8)  # 8, 16, ..., 512: 64 per-device batch sizes
DEVICE_COUNTS = np.arange(1, 65)  # 64 device counts
ACCUMULATION_STEPS = tuple(range(1, 9))  # 8 accumulation options
NODES, GPUS_PER_NODE, DEVICE_MEMORY_GIB = 8, 8, 80
NUM_SAMPLES, PRICE_PER_GPU_HOUR = 1_281_167, 2.0
TARGET_MS = 50.0
WARMUP = 2  # untimed runs before the timed ones


def handmade_job() -> tuple[JobSpec, list[dict]]:
    """A 64-device job profiled at every candidate batch, with exact lines (handmade_measurements' defaults)."""
    spec = JobSpec.model_validate(
        spec_dict(
            batch_sizes=DEVICE_BATCHES.tolist(),
            cluster={"nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "device_memory_gib": DEVICE_MEMORY_GIB},
            dataset={"name": "synthetic_images", "num_samples": NUM_SAMPLES},
            pricing={"kind": "gpu_hour", "price": PRICE_PER_GPU_HOUR},
            training={"reference_batch": 256, "reference_epochs": 90},
        )
    )
    measurements = [measurement(int(b), trace_sigma=2048.0) for b in DEVICE_BATCHES]
    return spec, measurements


FULL_SPACE = PlanInputs(  # the same cluster and pricing as the spec, over the full 64 x 64 x 8 space
    device_batches=DEVICE_BATCHES,
    total_devices=NODES * GPUS_PER_NODE,
    device_memory_bytes=DEVICE_MEMORY_GIB * GIB,
    num_samples=NUM_SAMPLES,
    pricing_kind="gpu_hour",
    price=PRICE_PER_GPU_HOUR,
    gpus_per_node=GPUS_PER_NODE,
    nodes=NODES,
    device_counts=DEVICE_COUNTS,
    accumulation_steps=ACCUMULATION_STEPS,
)


def timed_ms(run: Callable[[], object], repeats: int) -> np.ndarray:
    for _ in range(WARMUP):
        run()
    times_ms = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times_ms.append((time.perf_counter() - started) * 1e3)
    return np.array(times_ms)


def report(label: str, configs: int, times_ms: np.ndarray) -> dict:
    median_ms, p90_ms = float(np.median(times_ms)), float(np.percentile(times_ms, 90))
    print(f"{label:<44} {configs:>14} {median_ms:>10.2f} {p90_ms:>9.2f}")
    return {"configs": configs, "median_ms": median_ms, "p90_ms": p90_ms}


def wide_plan(spec: JobSpec, measurements: list[dict]) -> dict:
    """`recommend.plan` with its PlanInputs given the 64 device counts and 8 accumulation options."""
    widened = functools.partial(PlanInputs, device_counts=DEVICE_COUNTS, accumulation_steps=ACCUMULATION_STEPS)
    with mock.patch.object(recommend, "PlanInputs", widened):
        return recommend.plan(spec, measurements)


def time_planner(models, candidates: dict[str, np.ndarray], repeats: int) -> dict:
    """sweep + choose over FULL_SPACE (the headline), then each alone."""
    configs = int(candidates["global_batch"].size)
    headline = report("sweep + choose (knee)", configs, timed_ms(lambda: choose(sweep(models, FULL_SPACE), "knee"), repeats))
    report("  sweep alone", configs, timed_ms(lambda: sweep(models, FULL_SPACE), repeats))
    report("  choose alone (knee)", configs, timed_ms(lambda: choose(candidates, "knee"), repeats))
    return headline


def time_plan(spec: JobSpec, measurements: list[dict], repeats: int) -> None:
    """fit_models alone, then the whole recommend.plan over its own search space and over FULL_SPACE's."""
    parsed = [parse_measurement(record) for record in measurements]
    report("fit_models (64 measured points)", len(measurements), timed_ms(lambda: fit_models(spec, parsed), repeats))
    for label, run in (
        ("recommend.plan, its own search space", lambda: recommend.plan(spec, measurements)),
        ("recommend.plan, 64 x 64 x 8", lambda: wide_plan(spec, measurements)),
    ):
        report(label, len(run()["candidates"]), timed_ms(run, repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    spec, measurements = handmade_job()
    models, _ = fit_models(spec, [parse_measurement(record) for record in measurements])
    candidates = sweep(models, FULL_SPACE)
    configs = int(candidates["global_batch"].size)
    expected = DEVICE_BATCHES.size * placements(DEVICE_COUNTS, NODES, GPUS_PER_NODE)[0].size * len(ACCUMULATION_STEPS)
    if configs != expected:
        raise SystemExit(f"the sweep kept {configs} of {expected} configurations (memory limit too small?)")

    print(f"{'timed':<44} {'configs/points':>14} {'median ms':>10} {'p90 ms':>9}   ({args.repeats} repeats)")
    headline = time_planner(models, candidates, args.repeats)
    time_plan(spec, measurements, args.repeats)

    chosen = choose(candidates, "knee")
    b, n, a = (int(candidates[key][chosen.index]) for key in ("device_batch", "devices", "accumulation"))
    print(f"\nknee ({chosen.knee.method}): device batch {b} x {n} devices x {a} accumulation = global batch {b * n * a}")
    met = "met" if headline["median_ms"] < TARGET_MS else "missed"
    print(f"sweep + choose over {configs} configurations: median {headline['median_ms']:.2f} ms (target < {TARGET_MS:g} ms: {met})")
    print(f"planner_speed: configs={configs} median_ms={headline['median_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
