"""Multi-GPU step times on the Pollux traces: the placement-aware model against AdaptDL's `fit_perf_params`.

Both are fitted on the same rows and judged on the rest (held-out rows of placements.csv):
- profiled: what a short profiling run measures: single-GPU rows at 4 batch sizes spread in log2 over the
  measured range, plus placements 2, 3, 4, 11, 22, 1111 at one shared per-GPU batch: the lower median
  of the batches all six were measured at.
- generous: every single-GPU row plus 30% of all rows drawn at random (5 seeds; 1 with --quick).
- two batches (a robustness check, not in the summary line): the profiled rows plus the six placements at a
  second batch, each of the other profiled single-GPU batches in turn: how the shape choice holds up when
  the multi-GPU rows are few but gamma is identifiable.
AdaptDL runs in its own venv (`/tmp/tula-adaptdl-venv`, built once: `pip install --no-deps adaptdl` plus
autograd, numpy, scipy), in a subprocess fed JSON; it gets accum_step_time = step - sync (the compute
part) and optim_step_time = step, as its trainer measures them. If the venv cannot be built, AdaptDL
is reported as unavailable.

Decisions: per GPU count n and global batch B = n x (largest measured batch), the (placement, per-GPU
batch B/(n a), a accumulation steps) each model predicts fastest against the measured fastest; an
accumulated step costs (a - 1) x the measured compute part (step - sync) + one full step.

Usage: python benchmarks/multi_gpu_traces.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pollux_traces import APPLICATIONS, load_placement_rows  # noqa: E402
from tula_service.catalogs import interconnect  # noqa: E402
from tula_service.fit.perfmodel.placement import PlacementStepModel, StepRow, placement_features  # noqa: E402

PROFILED_PLACEMENTS = ("2", "3", "4", "11", "22", "1111")
# The testbed's links as its README states them (g4dn.12xlarge: T4s on PCIe 3.0, 50 Gbit/s Ethernet), from
# the interconnect catalog, as a user would name them in the spec: what a shape that fits no latency assumes.
TESTBED_LINKS = {"intra": "pcie3_x16", "inter": "ethernet_50g"}
GENEROUS_FRACTION = 0.3
# Gradient bytes = 4 x parameters of the network (fp32), public facts of the two models, not fitted:
# ResNet-18 (CIFAR variant) 11 173 962 parameters; ResNet-50 25 557 032.
GRADIENT_BYTES = {"cifar10": 4 * 11_173_962, "imagenet": 4 * 25_557_032}
ADAPTDL_VENV = Path("/tmp/tula-adaptdl-venv")
ADAPTDL_SCRIPT = r"""
import json, sys
import numpy as np
from adaptdl import goodput
data = json.load(sys.stdin)
train, test = data["train"], data["test"]
params = goodput.fit_perf_params(np.array(train["nodes"]), np.array(train["replicas"]), np.array(train["batch"]),
                                 np.array(train["accum_s"]), np.array(train["step_s"]))
accum = goodput._predict_accum_time(params, np.array(test["batch"], dtype=float))
network = goodput._predict_network_time(params, np.array(test["nodes"]), np.array(test["replicas"]))
step = np.exp(goodput._predict_log_optim_time(params, accum, network))
json.dump({"params": list(map(float, params)), "step_s": step.tolist(), "accum_s": accum.tolist()}, sys.stdout)
"""


def adaptdl_python() -> tuple[Path | None, str]:
    python = ADAPTDL_VENV / "bin" / "python"
    check = [str(python), "-c", "import adaptdl.goodput"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, "ok"
    try:
        subprocess.run(["python3", "-m", "venv", str(ADAPTDL_VENV)], check=True, capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "adaptdl"], check=True, capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "autograd", "numpy", "scipy"], check=True, capture_output=True)
        subprocess.run(check, check=True, capture_output=True)
        return python, "ok"
    except (subprocess.CalledProcessError, OSError) as error:
        detail = getattr(error, "stderr", b"") or b""
        return None, f"could not build {ADAPTDL_VENV}: {error} {detail.decode(errors='replace')[-300:]}"


def adaptdl_predict(python: Path, train: list[dict], test: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """AdaptDL's predicted (step seconds, compute seconds) of the test rows, fitted to the train rows."""
    def columns(rows):
        g, m, n = placement_features([r["placement"] for r in rows])
        return {"nodes": m.astype(int).tolist(), "replicas": n.astype(int).tolist(), "batch": [r["local_bsz"] for r in rows],
                "accum_s": [r["step_time_s"] - r["sync_time_s"] for r in rows], "step_s": [r["step_time_s"] for r in rows]}  # fmt: skip

    payload = json.dumps({"train": columns(train), "test": columns(test)})
    done = subprocess.run([str(python), "-c", ADAPTDL_SCRIPT], input=payload, capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout)
    return np.array(answer["step_s"]), np.array(answer["accum_s"])


def profiled_split(rows: list[dict]) -> np.ndarray:
    single = sorted({r["local_bsz"] for r in rows if r["placement"] == "1"})
    targets = np.exp2(np.linspace(np.log2(single[0]), np.log2(single[-1]), 4))
    chosen = {min(single, key=lambda b: abs(np.log2(b / t))) for t in targets}
    shared = set.intersection(*({r["local_bsz"] for r in rows if r["placement"] == p} for p in PROFILED_PLACEMENTS))
    ordered = sorted(shared)
    shared_batch = ordered[(len(ordered) - 1) // 2]  # the lower median
    return np.array([(r["placement"] == "1" and r["local_bsz"] in chosen)
                     or (r["placement"] in PROFILED_PLACEMENTS and r["local_bsz"] == shared_batch) for r in rows])  # fmt: skip


def two_batch_splits(rows: list[dict]) -> dict[float, np.ndarray]:
    """The profiled split plus the profiled placements at each other profiled single-GPU batch, one at a time."""
    profiled = profiled_split(rows)
    shared = {r["local_bsz"] for r, k in zip(rows, profiled) if k and r["placement"] != "1"}
    others = sorted({r["local_bsz"] for r, k in zip(rows, profiled) if k and r["placement"] == "1"} - shared)
    return {b: profiled | np.array([r["placement"] in PROFILED_PLACEMENTS and r["local_bsz"] == b for r in rows]) for b in others}


def generous_split(rows: list[dict], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([r["placement"] == "1" for r in rows]) | (rng.random(len(rows)) < GENEROUS_FRACTION)


def step_rows(rows: list[dict]) -> list[StepRow]:
    return [StepRow(tuple(int(c) for c in r["placement"]), r["local_bsz"], r["step_time_s"], r["sync_time_s"]) for r in rows]


def decisions(rows: list[dict], predicted_step_s: np.ndarray, predicted_compute_s: np.ndarray) -> dict:
    """Per GPU count: is the predicted fastest (placement, batch, accumulation) the measured fastest; regret."""
    batches = sorted({r["local_bsz"] for r in rows})
    index = {(r["placement"], r["local_bsz"]): i for i, r in enumerate(rows)}
    gpus = np.array([sum(int(c) for c in r["placement"]) for r in rows])
    result = {}
    for n in sorted(set(gpus.tolist()) - {1}):
        global_batch = n * batches[-1]
        options = []
        for placement in sorted({r["placement"] for r, k in zip(rows, gpus) if k == n}):
            for accumulation in (1, 2, 4, 8, 16, 32):
                local = global_batch / (n * accumulation)
                near = [b for b in batches if abs(np.log(b / local)) < 0.03 and (placement, b) in index]
                if not near:
                    continue
                i = index[(placement, near[0])]
                measured = (accumulation - 1) * (rows[i]["step_time_s"] - rows[i]["sync_time_s"]) + rows[i]["step_time_s"]
                predicted = (accumulation - 1) * predicted_compute_s[i] + predicted_step_s[i]
                options.append((placement, near[0], accumulation, measured, predicted))
        if len(options) < 2:
            continue
        best_measured = min(options, key=lambda o: o[3])
        best_predicted = min(options, key=lambda o: o[4])
        result[n] = {"options": len(options), "predicted": best_predicted[:3], "measured": best_measured[:3],
                     "same": best_predicted[:3] == best_measured[:3],
                     "throughput_regret": 1.0 - best_measured[3] / best_predicted[3]}  # fmt: skip
    return result


def errors_summary(predicted: np.ndarray, measured: np.ndarray) -> dict:
    errors = np.abs(predicted / measured - 1.0)
    return {"median": float(np.median(errors)), "p90": float(np.quantile(errors, 0.9)), "rows": int(errors.size)}


def evaluate(app_name: str, rows: list[dict], train: np.ndarray, python: Path | None) -> dict:
    started = time.perf_counter()
    links = {side: interconnect(name) for side, name in TESTBED_LINKS.items()}
    model = PlacementStepModel(**links, gradient_bytes=GRADIENT_BYTES[app_name]).fit(step_rows([r for r, k in zip(rows, train) if k]))
    fit_s = time.perf_counter() - started
    placements, batch = [r["placement"] for r in rows], np.array([r["local_bsz"] for r in rows])
    ours = model.predict_placements(placements, batch)
    g, m, n = placement_features(placements)
    ours_compute = model.micro_step_s(g, batch)
    measured = np.array([r["step_time_s"] for r in rows])
    test = ~train
    multi_node_small = test & (m > 1) & (batch <= np.median(batch))
    report = {"train_rows": int(train.sum()), "test_rows": int(test.sum()), "fit_s": fit_s, "model": model.describe(),
              "ours": errors_summary(ours[test], measured[test]),
              "ours_multi_node_small_batch": errors_summary(ours[multi_node_small], measured[multi_node_small]),
              "ours_decisions": decisions(rows, ours, ours_compute)}  # fmt: skip
    if python is not None:
        train_rows = [r for r, k in zip(rows, train) if k]
        theirs, theirs_compute = adaptdl_predict(python, train_rows, rows)
        report["adaptdl"] = errors_summary(theirs[test], measured[test])
        report["adaptdl_multi_node_small_batch"] = errors_summary(theirs[multi_node_small], measured[multi_node_small])
        report["adaptdl_decisions"] = decisions(rows, theirs, theirs_compute)
    return report


def noise_note(rows: list[dict]) -> str:
    """How much repeated structure disagrees: 44 vs 4444 at the smallest batch (same NIC load, fewer nodes)."""
    table = {(r["placement"], r["local_bsz"]): r["step_time_s"] for r in rows}
    smallest = min(r["local_bsz"] for r in rows)
    if ("44", smallest) in table and ("4444", smallest) in table:
        ratio = table[("4444", smallest)] / table[("44", smallest)]
        return (f"noise: at batch {smallest:g}, 4444 (4 nodes) took {ratio:.2f} x the step of 44 (2 nodes); any ring "
                "model says >= 1, so multi-node rows at small batches scatter by tens of percent")
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, writes only to a temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="folder for multi_gpu_traces.json")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2, 3, 4]
    out = Path(tempfile.mkdtemp(prefix="tula-multi-gpu-")) if args.quick or args.out is None else args.out
    python, status = adaptdl_python()
    print(f"adaptdl: {status}")
    results, totals = {}, {"ours_profiled": [], "ours_generous": [], "adaptdl_profiled": [], "adaptdl_generous": []}
    traces = 0
    for app_name, app in APPLICATIONS.items():
        rows = load_placement_rows(app)
        traces += len(rows)
        results[app_name] = {"profiled": evaluate(app_name, rows, profiled_split(rows), python),
                             "generous": [evaluate(app_name, rows, generous_split(rows, seed), python) for seed in seeds]}  # fmt: skip
        results[app_name]["two_batches"] = {str(b): evaluate(app_name, rows, split, python) for b, split in two_batch_splits(rows).items()}
        note = noise_note(rows)
        for split in ("profiled", "generous"):
            reports = results[app_name][split] if split == "generous" else [results[app_name][split]]
            ours_median = float(np.mean([r["ours"]["median"] for r in reports]))
            totals[f"ours_{split}"].append(ours_median)
            line = (f"{app_name:9s} {split:9s} train={reports[0]['train_rows']:4d} test={reports[0]['test_rows']:4d}  ours: "
                    f"median {ours_median:6.1%} p90 {np.mean([r['ours']['p90'] for r in reports]):6.1%}"
                    f" ({reports[0]['model']['chosen']}, fit {reports[0]['fit_s']:.1f}s)")  # fmt: skip
            if python is not None:
                theirs_median = float(np.mean([r["adaptdl"]["median"] for r in reports]))
                totals[f"adaptdl_{split}"].append(theirs_median)
                line += f"  adaptdl: median {theirs_median:6.1%} p90 {np.mean([r['adaptdl']['p90'] for r in reports]):6.1%}"
            print(line)
            small = reports[0]["ours_multi_node_small_batch"]
            print(f"          multi-node rows at batch <= median: ours median {small['median']:.1%} over {small['rows']} rows"
                  + (f", adaptdl {reports[0]['adaptdl_multi_node_small_batch']['median']:.1%}" if python else ""))
            for who in ("ours", "adaptdl") if python else ("ours",):
                picks = reports[0][f"{who}_decisions"]
                same = sum(d["same"] for d in picks.values())
                regret = [d["throughput_regret"] for d in picks.values()]
                print(f"          {who} decisions: best (placement, batch, accumulation) right for {same}/{len(picks)} GPU counts,"
                      f" throughput regret median {np.median(regret):.1%} max {np.max(regret):.1%}")
        two = results[app_name]["two_batches"]
        print("          two batches (profiled + the six placements at a second batch): ours "
              + ", ".join(f"{b}: {r['ours']['median']:.1%} ({r['model']['chosen']})" for b, r in two.items())
              + ("; adaptdl " + ", ".join(f"{b}: {r['adaptdl']['median']:.1%}" for b, r in two.items()) if python else ""))
        params = results[app_name]["profiled"]["model"]["params"]
        print(f"          profiled fit: {json.dumps(params, default=float)[:400]}")
        if note:
            print(f"          {note}")
    (out / "multi_gpu_traces.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out / 'multi_gpu_traces.json'}")
    pct = lambda key: f"{100 * np.mean(totals[key]):.1f}" if totals[key] else "unavailable"  # noqa: E731
    print(f"multi_gpu_traces: traces={traces} profiled_median_err_pct={pct('ours_profiled')} "
          f"generous_median_err_pct={pct('ours_generous')} adaptdl_profiled_median_err_pct={pct('adaptdl_profiled')} "
          f"adaptdl_generous_median_err_pct={pct('adaptdl_generous')}")


if __name__ == "__main__":
    main()
