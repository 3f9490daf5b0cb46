"""What the client commands print for people: progress, jobs, recommendations, what-ifs, the GPU catalog.

Numbers are in human units (`human.py`); `--json` prints the server's exact values instead.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tula_service.cli.common import one_line, table, when
from tula_service.cli.human import human_bandwidth, human_bytes, human_duration, human_number, human_usd
from tula_service.units import GIB

if TYPE_CHECKING:
    from tula_service.schemas import JobView

class ProgressPrinter:
    """A live bar on a terminal; one line per change otherwise (logs, CI)."""

    def __init__(self, stream=sys.stdout, width: int = 30):
        self.stream = stream
        self.width = width
        self._last: tuple | None = None
        self._shown = 0

    def __call__(self, job: JobView) -> None:
        done, total, step = job.progress.points_done, job.progress.points_total, job.progress.step
        if (done, job.state, step) == self._last:
            return
        self._last = (done, job.state, step)
        filled = int(self.width * done / total) if total else self.width
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} points  {job.state:<10}"
        if step and step != job.state:
            line += f"  {step}"
        if self.stream.isatty():
            print(f"\r{line:<{self._shown}}", end="", file=self.stream, flush=True)
            self._shown = len(line)
        else:
            print(line.rstrip(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.stream.isatty():
            print(file=self.stream)


def _setting(value) -> str:
    """An optimizer setting as the spec writes it: true/false, [b1, b2], a number."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}"


def format_recommendation(rec: dict[str, Any]) -> str:
    chosen = rec["chosen"]
    reliability = rec.get("reliability") or {}
    lines = [] if reliability.get("verdict") != "unreliable" else [
        f"WARNING: {reliability['message']}", *(f"  - {reason}" for reason in reliability["reasons"]), "",
    ]  # fmt: skip
    lines += [
        f"objective: {rec['objective']}"
        + (f"  (knee by {rec['knee']['method']}, S={rec['knee']['sensitivity']}, on {rec['knee']['curve']})" if rec.get("knee") else ""),
        f"chosen: global batch {chosen['global_batch']} = device batch {chosen['device_batch']}"
        f" x {_devices(chosen)} devices x {chosen['accumulation']} accumulation",
        f"  predicted total time {human_duration(chosen['total_time_s']['value'])},"
        f" cost {human_usd(chosen['cost_usd']['value'])}, memory {_memory(chosen)}"
        f" ({chosen['memory_bytes']['source']}), epochs {human_number(chosen['epochs']['value'])} ({chosen['epochs']['source']})",
    ]
    if chosen["epochs"].get("calibrated_interval"):
        runs = _evidence(rec) == "other_runs"
        lines.append(f"  80% interval: epochs {_range(chosen['epochs']['calibrated_interval'])}, total time "
                     f"{_range(chosen['total_time_s']['calibrated_interval'], human_duration)} ("
                     + ("the fit to the measured runs, a run's scatter included" if runs else "the epochs model's error measured across tasks")
                     + "; see B_noise below)")  # fmt: skip
    if chosen["epochs"].get("interval"):
        lines.append(f"  epochs with the LR capped: {_range(chosen['epochs']['interval'])} (no cost from the cap to the "
                     "quadratic model's; the value is their geometric middle)")
    if chosen.get("extrapolated"):
        lines.append(f"  step time extrapolated: {', '.join(chosen['extrapolated'])} beyond every multi-device measurement")
    edge = (rec.get("search_space") or {}).get("chosen_at_edge")
    if edge:
        lines.append(f"  at the edge of the search: {edge['why']}")
    knee = rec.get("knee") or {}
    if knee.get("method_explained") and rec["objective"] == "knee":
        lines.append(f"  {knee['method']}: {knee['method_explained']}")
    if rec.get("constraint"):
        lines.append(f"  {rec['constraint']['message']}")
    lines += _noise_scale_lines((rec.get("models") or {}).get("efficiency") or {})
    advice = rec.get("training_advice")
    if advice:
        lr, ags, schedule = advice["lr_rule"], advice["ags"], advice["batch_schedule"]
        lines.append(
            f"  LR x{lr['multiplier']['value']:.2f} ({lr['recommended']}, {lr['multiplier']['source']})"
            + (f" = {lr['lr']['value']:.4g}" if lr.get("lr") else "")
            + f"; warm-up {advice['warmup']['steps']} steps; AGS delta={ags['delta']['value']:.3g} s={ags['s']['value']:.3g}"
        )
        assumed = {name: setting["value"] for name, setting in (lr.get("optimizer_settings") or {}).items() if setting["source"] == "assumed"}
        if assumed:
            lines.append(f"    - {lr['optimizer']} settings assumed (training.<name>; profiling, the pilot and the advice use them): "
                         + ", ".join(f"{name} {_setting(value)}" for name, value in assumed.items()))
        if (lr.get("stability") or {}).get("source") in ("assumed", "measured"):
            lines.append(f"    - LR stability {lr['stability']['why']}")
        lines.append(f"  batch schedule: {schedule['recommended']} ({schedule['why']})")
        stages = schedule["schedules"][schedule["recommended"]]["stages"]
        if len(stages) > 1:
            lines.append("    " + ", ".join(f"{st['global_batch']} from epoch {st['from_epoch']:.3g}" for st in stages))
    front = sorted((c for c in rec["candidates"] if c["pareto"]), key=lambda c: c["global_batch"])
    rows = [
        [c["global_batch"], c["device_batch"], _devices(c), c["accumulation"], _memory(c),
         human_duration(c["iter_time_s"]["value"]), human_number(c["epochs"]["value"]), _calibrated_range(c["epochs"]),
         human_duration(c["total_time_s"]["value"]), human_usd(c["cost_usd"]["value"])]
        for c in front
    ]  # fmt: skip
    lines += ["", table(["BATCH", "DEVICE_B", "DEVICES", "ACC", "MEMORY", "ITER", "EPOCHS", "EPOCHS_80%", "TOTAL", "COST"], rows, align=">")]
    lines.append(f"({len(rec['candidates'])} candidates in all; Pareto front shown; --json for everything)")
    return "\n".join(lines)


def _evidence(rec: dict[str, Any]) -> str | None:
    """Which evidence set the noise scale (models.efficiency.noise_scale.evidence), None where none did."""
    noise = ((rec.get("models") or {}).get("efficiency") or {}).get("noise_scale")
    return noise.get("evidence") if noise else None


def _started_from(efficiency: dict[str, Any], evidence: str) -> str:
    """", started from initial_weights PATH" where the profiler's own training (pilot, points) began at the spec's
    checkpoint; nothing for the usual random init."""
    used = next((c for c in efficiency.get("evidence", {}).get("candidates", []) if c.get("source") == evidence), {})
    start = (used.get("detail") or {}).get("started_from") or ""
    return f", started from {start}" if start.startswith("initial_weights") else ""


def _noise_scale_lines(efficiency: dict[str, Any]) -> list[str]:
    """B_noise with its interval and evidence, and every caveat on it (tula_service.fit.efficiency_evidence)."""
    noise = efficiency.get("noise_scale")
    if not noise:
        return ([f"  epochs: {efficiency['note']}"] if efficiency.get("note") else []) + _next_run_lines(efficiency)
    interval = noise.get("interval")
    line = (f"  noise scale B_noise {human_number(noise['value'])}"
            + (f" [{_range(interval)}]" if interval else "")  # not "[36, 405,414]": the thousands' comma reads as a third number
            + f" from {noise['evidence'].replace('_', ' ')}" + _started_from(efficiency, noise["evidence"])
            + (" (weak evidence)" if efficiency.get("weak") else ""))  # fmt: skip
    calibrated = noise.get("calibrated_interval")
    if calibrated:
        line += f"; 80% interval {_range(calibrated['value'])} ({calibrated['why']})"
    assumes = [f"  epochs assume: {efficiency['assumes_lr']}"] if efficiency.get("assumes_lr") else []
    return [line, *assumes, *(f"    - {warning}" for warning in efficiency.get("warnings", [])), *_next_run_lines(efficiency)]


def _next_run_lines(efficiency: dict[str, Any]) -> list[str]:
    """The run that would settle the epochs (efficiency_evidence.next_run), when there is one to suggest."""
    run = efficiency.get("next_run")
    if not run:
        return []
    interval = f" (80%: {_range(run['predicted_epochs_interval'])})" if run.get("predicted_epochs_interval") else ""
    return [f"  to settle the epochs: measure a run at global batch {run['batch']} to the same target and give its epochs as "
            f"training.other_runs (predicted now: {human_number(run['predicted_epochs'])} epochs{interval}; "
            f"tula plan JOB --other-run {run['batch']}:EPOCHS)"]


def _range(ends: list[float], human: Any = human_number) -> str:
    """An interval as "lo-hi", each end in human units."""
    return f"{human(ends[0])}-{human(ends[1])}"


def _calibrated_range(quantity: dict[str, Any]) -> str:
    """The epochs' calibrated 80% interval as "lo-hi" ("-" without one; tula_service.fit.epochs_calibration)."""
    interval = quantity.get("calibrated_interval")
    return _range(interval) if interval else "-"


def _devices(candidate: dict[str, Any]) -> str:
    """4 devices on one node: "4"; on several: "4 (2+2)", the GPUs used on each node."""
    placement = candidate.get("placement") or [candidate["devices"]]
    return str(candidate["devices"]) + (f" ({'+'.join(map(str, placement))})" if len(placement) > 1 else "")


def _memory(candidate: dict[str, Any]) -> str:
    value = candidate["memory_bytes"]["value"]
    return "not measured" if value is None else human_bytes(value)


def compare_with_stored(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What differs from the stored recommendation, as shown (a time equal to three digits is the same)."""
    old, new = before["chosen"], after["chosen"]
    shown = [
        ("global batch", str(old["global_batch"]), str(new["global_batch"])),
        ("devices", str(old["devices"]), str(new["devices"])),
        ("total time", human_duration(old["total_time_s"]["value"]), human_duration(new["total_time_s"]["value"])),
        ("cost", human_usd(old["cost_usd"]["value"]), human_usd(new["cost_usd"]["value"])),
    ]
    changed = [f"{name} {was} -> {now}" for name, was, now in shown if was != now]
    same = [f"{name} {was}" for name, was, now in shown if was == now]
    if not changed:
        return "the same as the stored recommendation: " + ", ".join(same)
    return "compared with the stored recommendation: " + ", ".join(changed) + (f" (unchanged: {', '.join(same)})" if same else "")


def describe_what_if(job_id: str, changes: list[str], unchanged: list[str]) -> str:
    if changes:
        return f"what-if for job {job_id}: " + "; ".join(changes) + (f" (unchanged: {', '.join(unchanged)})" if unchanged else "")
    if unchanged:
        already = f"{unchanged[0]} is the job's value" if len(unchanged) == 1 else f"{', '.join(unchanged)} are the job's values"
        return f"what-if for job {job_id}: nothing changes ({already} already); the stored spec re-planned"
    return f"what-if for job {job_id}: no changes (the stored spec re-planned)"


def _points(job: JobView) -> str:
    return f"{job.progress.points_done}/{job.progress.points_total}"


def _chosen_summary(chosen: dict[str, Any] | None) -> str:
    if not chosen:
        return "-"
    accumulation = f" x{chosen['accumulation']} acc" if chosen.get("accumulation", 1) > 1 else ""
    return f"{chosen['global_batch']} on {chosen['devices']} dev{accumulation}"


def _point_label(kind: str, batch_size: int | None) -> str:
    if kind == "comm":
        return "all-reduce"
    return f"{batch_size}" + {"search": " (search)", "pilot": " (pilot)"}.get(kind, "")


def format_job_list(jobs: list[JobView]) -> str:
    rows = [
        [job.id, job.name or "-", job.model, job.state, _points(job), _chosen_summary(job.chosen), when(job.created_at)]
        for job in jobs
    ]
    return table(["ID", "NAME", "MODEL", "STATE", "POINTS", "CHOSEN (batch on devices)", "CREATED (UTC)"], rows)


def describe_job(job: JobView) -> str:
    # The states are db.py's; imported here, not with the module, as db.py imports SQLAlchemy.
    from tula_service.store.states import ACTIVE_JOB_STATES, ACTIVE_POINT_STATES, TERMINAL_JOB_STATES

    progress = job.progress
    lines = [
        f"job {job.id}" + (f" ({job.name})" if job.name else "") + f": {job.state}, {_points(job)} points"
        + (f", {progress.points_failed} failed" if progress.points_failed else "")
        + (f", {progress.points_retried} retried" if progress.points_retried else ""),
        f"  {job.model} on {job.dataset}; created {when(job.created_at)}"
        + (f", finished {when(job.finished_at)}" if job.finished_at else "") + " (UTC)",
    ]
    if job.state in ACTIVE_JOB_STATES and progress.step:
        lines.append(f"  now: {progress.step}")
    if job.error:
        lines.append(f"  error: {job.error}")
    if job.points:
        rows = [
            [_point_label(p.kind, p.batch_size), p.state, str(p.attempts),
             human_duration(p.duration_s) if p.duration_s is not None else "-", one_line(p.error)]
            for p in job.points
        ]  # fmt: skip
        lines += ["", table(["BATCH", "STATE", "ATTEMPTS", "DURATION", "ERROR"], rows)]
    if job.state in TERMINAL_JOB_STATES:
        groups = {"out of memory": ("oom",), "failed": ("failed",), "not measured": (*ACTIVE_POINT_STATES, "cancelled")}
        for title, states in groups.items():
            labels = [_point_label(p.kind, p.batch_size) for p in job.points if p.state in states]
            if labels:
                lines.append(f"{title}: batch {', '.join(labels)}")
    return "\n".join(lines)


def format_gpu_catalog(gpus: list[dict[str, Any]]) -> str:
    """One row per GPU in human units; the datasheet notes and exact values are in --json."""

    def unit(value: Any, shown) -> str:
        return "-" if value is None else shown(value)

    rows = [
        [gpu["name"], unit(gpu.get("memory_gib"), lambda gib: human_bytes(gib * GIB)),
         unit(gpu.get("memory_bandwidth_gbps"), human_bandwidth),
         unit(gpu.get("peak_bf16_tflops"), lambda tflops: f"{human_number(tflops)} TFLOPS"),
         gpu.get("intra_node_link") or "-", unit(gpu.get("default_price_usd_per_hour"), lambda usd: f"{human_usd(usd)}/GPU-hour"),
         gpu.get("source") or "-"]
        for gpu in gpus
    ]  # fmt: skip
    headers = ["NAME", "MEMORY", "BANDWIDTH", "BF16 DENSE", "LINK", "PRICE", "SOURCE"]
    return table(headers, rows) + "\n(datasheet notes and exact values: --json)"
