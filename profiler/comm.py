"""All-reduce micro-benchmark: the measured points behind the network model.

Measures the time of one blocking `torch.distributed.all_reduce` (SUM, float32) of `message_bytes`
across `world_size` processes on this host, for message sizes in x4 steps from 1 KiB up to the
model's gradient size. `tula_service.fit.perfmodel.comm_fit` fits the points to the ring model

    T(n, S) = 2 (n - 1) * latency_s + 2 (n - 1) / n * S / bandwidth_bytes_per_s

- NCCL when this host has at least two CUDA devices: one process per device, world sizes
  2..device count, each call timed with CUDA events.
- gloo otherwise: 2..4 CPU processes (default world sizes 2 and 4) over loopback TCP, each call
  timed with perf_counter. This measures one host's memory copies and TCP stack, not a GPU
  interconnect; the record's `backend`, `device` and `measured` fields say so, and
  `informs_network_model` is false: the fit reports it next to the network model and does not use
  it (`tula_service.fit.fitting`). So gloo runs the shorter `GLOO_POLICY` (0.1 s per size, not 0.25 s).

Every rank times every iteration; an iteration's time is the max over ranks (the collective is done
when its slowest rank is done). Per (world size, size) the record keeps median, p10, p90 and count.

gloo ranks are forked from this process (torch.multiprocessing, "fork"), so they start with torch
already imported: a spawned rank spends seconds importing it again, on the very cores being
measured (world sizes 2 and 4 on a 2-core host: 15 s spawned, under 3 s forked). Forking is safe:
the CLI (and the warm worker's child that runs it) runs no torch operation before it forks, so no
OpenMP pool or CUDA context exists to be copied half-made, and each rank sets one intra-op thread
before its first operation, as a DataLoader worker does. NCCL ranks are spawned ("spawn"): a CUDA
runtime does not survive a fork. The record's `launcher` says which. The ranks meet at a TCPStore that this process hosts on 127.0.0.1 (the OS
picks the free port, so no port race) and die with this process (PR_SET_PDEATHSIG), so a killed
benchmark leaves no rank waiting on a collective. A rank that raises, dies or runs past the timeout
ends the launch: the survivors are terminated, then killed, and the failure is returned as data
(`"status": "failed"`, `"error": ...`).

CLI: `python -m profiler.comm --max-bytes N [--world-sizes 2,4] [--backend auto|gloo|nccl] --out FILE`
writes one JSON record. Exit code 0 means FILE holds a record, "ok" or "failed" (as in
`profiler.run_point`); a failed record's error is also printed to stderr. `profiler.ray_group` runs
the same per-rank sweep (`all_reduce_sweep`) across Ray actors, for the Ray executor.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEMA_VERSION = 1
FLOAT32_BYTES = 4
MIN_MESSAGE_BYTES = 1024
SIZE_STEP = 4
CPU_MESSAGE_BYTES_CAP = 4 * 2**20  # larger gloo messages on 2 CPU cores add seconds, not information
CUDA_MESSAGE_BYTES_CAP = 2**30
CPU_WORLD_SIZES = (2, 4)
CPU_MAX_WORLD_SIZE = 4
LOOPBACK_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0
POLL_S = 0.1
JOIN_GRACE_S = 5.0
RANK_TIMEOUT_MARGIN_S = 5.0  # the ranks' own timeouts run this far past the launch's, which ends first
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class CommPolicy:
    """Iterations per (world size, message size).

    After `warmup_iters` untimed calls, the ranks agree (max over ranks) on the warm-up time per call
    and run `seconds_per_size / that` timed calls, clipped to [min_iters, max_iters]; every rank must
    run the same number of collectives, so the count is agreed, never decided locally.
    """

    warmup_iters: int = 3
    min_iters: int = 5
    max_iters: int = 100
    seconds_per_size: float = 0.25

    def __post_init__(self):
        if self.warmup_iters < 1 or not 1 <= self.min_iters <= self.max_iters:
            raise ValueError(f"need warmup_iters >= 1 and 1 <= min_iters <= max_iters, got {self}")


GLOO_POLICY = CommPolicy(seconds_per_size=0.1)  # not used by the network model: ~2 s on 2 cores, not ~3 s


def default_policy(backend: str) -> CommPolicy:
    """CommPolicy() on NCCL (the fitted intra-node link), GLOO_POLICY on gloo (reported only)."""
    return CommPolicy() if backend == "nccl" else GLOO_POLICY


class RankFailure(RuntimeError):
    """A rank raised, exited without a result, or the launch ran past its timeout."""


def message_sizes(max_bytes: int, min_bytes: int = MIN_MESSAGE_BYTES, step: int = SIZE_STEP) -> list[int]:
    """min_bytes, min_bytes * step, ... below max_bytes, then max_bytes itself (whole float32s)."""
    top_bytes = int(max_bytes) // FLOAT32_BYTES * FLOAT32_BYTES
    if top_bytes < FLOAT32_BYTES:
        raise ValueError(f"max_bytes must hold at least one float32 ({FLOAT32_BYTES} bytes), got {max_bytes}")
    sizes, size = [], min_bytes
    while size < top_bytes:
        sizes.append(size)
        size *= step
    return sizes + [top_bytes]


def resolve_backend(backend: str, cuda_devices: int | None = None) -> str:
    """Resolve "auto": NCCL with two or more CUDA devices, else gloo on CPU. `cuda_devices` defaults
    to this host's count (`profiler.ray_group` passes the Ray cluster's GPU count)."""
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count()
    if backend == "auto":
        return "nccl" if dist.is_nccl_available() and cuda_devices >= 2 else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend '{backend}' is not supported; known: auto, gloo, nccl")
    if backend == "nccl" and not (dist.is_nccl_available() and cuda_devices > 0):
        raise ValueError("backend 'nccl' needs CUDA devices and a torch build with NCCL; none here")
    return backend


def plan_world_sizes(
    backend: str,
    world_sizes: Sequence[int] | None,
    max_world_size: int | None,
    limit: int | None = None,
    reason: str | None = None,
) -> list[int]:
    """Default: 2..device count on NCCL, (2, 4) on gloo; all capped by `max_world_size`.
    `limit` and its `reason` replace this host's device count (or CPU_MAX_WORLD_SIZE on gloo)."""
    if limit is not None:
        reason = reason or "ranks available"
    elif backend == "nccl":
        limit, reason = torch.cuda.device_count(), "one process per CUDA device"
    else:
        limit, reason = CPU_MAX_WORLD_SIZE, "CPU processes on one host"
    if max_world_size is not None:
        limit, reason = min(limit, max_world_size), f"{reason}, max_world_size={max_world_size}"
    if world_sizes is None:
        world_sizes = range(2, limit + 1) if backend == "nccl" else [w for w in CPU_WORLD_SIZES if w <= limit]
    planned = sorted({int(w) for w in world_sizes})
    impossible = [w for w in planned if not 2 <= w <= limit]
    if impossible or not planned:
        raise ValueError(f"world sizes {impossible or planned} are impossible: {backend} allows 2..{limit} ({reason})")
    return planned


def start_method(backend: str) -> str:
    """How ranks start: "fork" for gloo (torch already imported), "spawn" for NCCL (a CUDA runtime
    does not survive a fork) and where this platform cannot fork."""
    return "fork" if backend == "gloo" and "fork" in mp.get_all_start_methods() else "spawn"


def run_on_ranks(
    target: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run `target(rank, world_size, device, *args)` in `world_size` processes (forked on gloo,
    spawned on NCCL: `start_method`) that share one process group; return the per-rank results in
    rank order, or raise RankFailure.

    Whatever happens, no process is left behind: on success each one gets JOIN_GRACE_S to exit;
    on failure the survivors are terminated at once (they may be blocked in a collective), then killed.
    The launch's `timeout_s` is enforced here; the ranks' store and process-group timeouts are set
    RANK_TIMEOUT_MARGIN_S later, so a launch that runs out of time is reported as such, not as a
    rank's own store timeout (a forked rank is at the store within milliseconds).

    Every rank is started before the TCPStore is, and gets its port through a pipe: the store serves
    connections on a thread of its own, and a process forked while another thread holds a lock
    inherits that lock, held forever. Forked after the store, 11 of 40 launches of world size 4 hung
    on a busy 2-core host (the last rank alone on a futex, before its process group); forked before
    it, none of 600. So a caller that runs threads of its own should not launch gloo ranks; the
    CLI has none but OpenBLAS's idle pool (which OpenBLAS shuts down around a fork itself), and the
    warm worker's child that runs it has none at all.
    """
    context = mp.get_context(start_method(backend))
    results = context.Queue()
    port_pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, backend, port_pipes[rank][0], timeout_s, target, args, results),
            name=f"tula-comm-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    grace_s = 0.0
    try:
        for process in processes:
            process.start()
        store = dist.TCPStore(LOOPBACK_HOST, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        for _, port_writer in port_pipes:
            port_writer.send(store.port)
        by_rank = _collect(processes, results, timeout_s)
        grace_s = JOIN_GRACE_S
        return by_rank
    finally:
        _stop(processes, grace_s)
        results.close()
        for connection in (end for pipe in port_pipes for end in pipe):
            connection.close()


def _rank_main(rank, world_size, backend, port_reader, timeout_s, target, args, results) -> None:
    try:
        _die_with_parent()
        _use_loopback()
        torch.set_num_threads(1)  # the ranks share the host's cores; no intra-op threads on top
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not port_reader.poll(timeout_s + RANK_TIMEOUT_MARGIN_S):
            raise TimeoutError(f"the launcher sent no store port within {timeout_s + RANK_TIMEOUT_MARGIN_S:g} s")
        timeout = timedelta(seconds=timeout_s + RANK_TIMEOUT_MARGIN_S)
        store = dist.TCPStore(LOOPBACK_HOST, port_reader.recv(), world_size, False, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
        results.put((rank, "ok", target(rank, world_size, device, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it; a rank must never die silently
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent() -> None:
    """SIGKILL this rank when the process that started it dies (Linux; elsewhere the launch's timeout
    and `_stop` are the only bounds). A rank blocked in a collective would otherwise wait out the
    store's timeout after its launcher was killed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    launcher = mp.parent_process()
    if launcher is not None and not launcher.is_alive():
        os._exit(1)  # the launcher died before the death signal was armed


def _use_loopback() -> None:
    """Keep gloo's and NCCL's own sockets on the loopback interface (this is a one-host benchmark)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = names[0] if names else "lo"


def _collect(processes: list, results, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, Any] = {}
    while len(by_rank) < len(processes):
        pending = [rank for rank in range(len(processes)) if rank not in by_rank]
        left_s = deadline - time.monotonic()
        if left_s <= 0:  # checked before every wait, so ranks that answer quickly cannot outrun it
            raise RankFailure(f"timed out after {timeout_s:g} s; ranks {pending} had not finished")
        try:
            rank, status, payload = results.get(timeout=min(POLL_S, left_s))
        except queue.Empty:
            for rank in pending:
                exitcode = processes[rank].exitcode
                if exitcode not in (None, 0):
                    raise RankFailure(f"rank {rank} exited with code {exitcode} without a result") from None
            continue
        if status == "error":
            raise RankFailure(f"rank {rank} failed:\n{payload}")
        by_rank[rank] = payload
    return [by_rank[rank] for rank in range(len(processes))]


def _stop(processes: list, grace_s: float) -> None:
    started = [process for process in processes if process.pid is not None]
    deadline = time.monotonic() + grace_s
    for process in started:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in started:
        if process.is_alive():
            process.terminate()
    for process in started:
        process.join(JOIN_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def all_reduce_sweep(
    rank: int, world_size: int, device: torch.device, sizes: list[int], policy: CommPolicy = CommPolicy()
) -> list[dict]:
    """One rank's part of the benchmark on the default process group, which this process has
    already joined (`profiler.ray_group` forms it across Ray actors); every rank returns the same
    points (max over ranks)."""
    return _all_reduce_points(rank, world_size, device, sizes, policy)


def _all_reduce_points(
    rank: int, world_size: int, device: torch.device, sizes: list[int], policy: CommPolicy
) -> list[dict]:
    """One rank's part of the benchmark; every rank returns the same points (max over ranks)."""
    points = []
    for message_bytes in sizes:
        tensor = torch.zeros(message_bytes // FLOAT32_BYTES, dtype=torch.float32, device=device)  # sums stay 0
        iters = _agreed_iters(tensor, policy)
        slowest_s = torch.tensor(_timed_all_reduces(tensor, iters), dtype=torch.float64, device=device)
        dist.all_reduce(slowest_s, op=dist.ReduceOp.MAX)
        times_s = slowest_s.cpu().numpy()
        points.append(
            {
                "world_size": world_size,
                "message_bytes": message_bytes,
                "median_s": float(np.median(times_s)),
                "p10_s": float(np.percentile(times_s, 10)),
                "p90_s": float(np.percentile(times_s, 90)),
                "count": int(times_s.size),
            }
        )
    return points


def _agreed_iters(tensor: torch.Tensor, policy: CommPolicy) -> int:
    _synchronize(tensor.device)
    started = time.perf_counter()
    for _ in range(policy.warmup_iters):
        dist.all_reduce(tensor)
    _synchronize(tensor.device)
    per_call_s = (time.perf_counter() - started) / policy.warmup_iters
    slowest_s = torch.tensor([per_call_s], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(slowest_s, op=dist.ReduceOp.MAX)
    wanted = math.ceil(policy.seconds_per_size / max(slowest_s.item(), 1e-9))
    return int(min(max(wanted, policy.min_iters), policy.max_iters))


def _timed_all_reduces(tensor: torch.Tensor, iters: int) -> list[float]:
    if tensor.is_cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            dist.all_reduce(tensor)
            end.record()
        torch.cuda.synchronize(tensor.device)
        return [start.elapsed_time(end) / 1000.0 for start, end in events]
    times_s = []
    for _ in range(iters):
        started = time.perf_counter()
        dist.all_reduce(tensor)
        times_s.append(time.perf_counter() - started)
    return times_s


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe(backend: str) -> dict[str, Any]:
    if backend == "nccl":
        return {
            "device": torch.cuda.get_device_name(0),
            "timing": "cuda_events",
            "measured": "NCCL all-reduce (SUM, float32) between the CUDA devices of one host, one process each",
            "informs_network_model": True,
        }
    return {
        "device": "cpu",
        "timing": "perf_counter",
        "measured": "gloo all-reduce (SUM, float32) between CPU processes of one host over loopback TCP; "
        "memory copies and the TCP stack, not a GPU interconnect",
        "informs_network_model": False,
    }


def new_record(
    max_bytes: int,
    world_sizes: Sequence[int] | None,
    backend: str,
    message_bytes_cap: int | None,
    policy: CommPolicy,
) -> dict[str, Any]:
    """The record's fields before measuring: status "ok", no points yet."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "comm",
        "status": "ok",
        "backend": backend,
        "device": None,
        "max_bytes": int(max_bytes),
        "message_bytes_cap": message_bytes_cap,
        "world_sizes": list(world_sizes) if world_sizes is not None else None,
        "policy": asdict(policy),
        "points": [],
        "error": None,
        "torch_version": torch.__version__,
        "hostname": socket.gethostname(),
    }


def measure_all_reduce(
    max_bytes: int,
    world_sizes: Sequence[int] | None = None,
    backend: str = "auto",
    max_world_size: int | None = None,
    message_bytes_cap: int | None = None,
    policy: CommPolicy | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Benchmark all-reduce up to min(max_bytes, message_bytes_cap) bytes; never raises.

    `message_bytes_cap` defaults to CPU_MESSAGE_BYTES_CAP (4 MiB) on gloo and CUDA_MESSAGE_BYTES_CAP
    (1 GiB) on NCCL; `policy` to `default_policy(backend)`. `timeout_s` bounds each world size's
    launch (start, rendezvous and all sizes). On failure the record keeps the points of the world
    sizes that finished.
    """
    started = time.perf_counter()
    record = new_record(max_bytes, world_sizes, backend, message_bytes_cap, policy or CommPolicy())
    try:
        record["backend"] = backend = resolve_backend(backend)
        policy = policy or default_policy(backend)
        record.update(_describe(backend), policy=asdict(policy), launcher=f"{start_method(backend)}ed_processes")
        cap = message_bytes_cap or (CUDA_MESSAGE_BYTES_CAP if backend == "nccl" else CPU_MESSAGE_BYTES_CAP)
        record["message_bytes_cap"] = cap
        sizes = message_sizes(min(int(max_bytes), cap))
        record["world_sizes"] = planned = plan_world_sizes(backend, world_sizes, max_world_size)
        for world_size in planned:
            try:
                points = run_on_ranks(_all_reduce_points, world_size, backend, (sizes, policy), timeout_s)[0]
            except RankFailure as error:
                raise RankFailure(f"world size {world_size}: {error}") from None
            record["points"].extend(points)
    except Exception as error:  # noqa: BLE001 - a failed benchmark is data for the caller
        record.update(status="failed", error=f"{type(error).__name__}: {error}")
    record["elapsed_s"] = time.perf_counter() - started
    return record


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4; got '{text}'") from None


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options without `--out` (shared with `profiler.ray_group`)."""
    parser = argparse.ArgumentParser(prog="python -m profiler.comm", description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", required=True, type=int, help="largest message: the model's gradient bytes")
    parser.add_argument("--world-sizes", type=_int_list, help="e.g. 2,4 (default: 2..devices on NCCL, 2,4 on gloo)")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--max-world-size", type=int, help="cap on the default or given world sizes")
    parser.add_argument("--message-bytes-cap", type=int, help="default: 4 MiB on gloo, 1 GiB on NCCL")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="per world size")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--out", required=True, type=Path, help="where to write the JSON record")
    args = parser.parse_args(argv)

    record = measure_all_reduce(
        args.max_bytes, args.world_sizes, args.backend, args.max_world_size, args.message_bytes_cap,
        timeout_s=args.timeout_s,
    )  # fmt: skip
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1))
    partial.replace(args.out)
    if record["status"] != "ok":
        print(record["error"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
