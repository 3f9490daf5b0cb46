"""The all-reduce benchmark of `profiler.comm`, run across a group of Ray actors.

The Ray executor (`tula_service.dispatch.ray_executor`) measures a job's communication here instead of in
one `python -m profiler.comm` process tree, so the ranks can sit on the cluster's devices:

- Backend and world sizes as `profiler.comm` plans them, counted on the Ray cluster: NCCL when the
  cluster has >= 2 GPUs (one actor per GPU, `num_gpus=1`; world sizes 2..cluster GPUs), else gloo
  on CPU actors of CPU_PER_RANK = 0.45 CPU each (world sizes (2, 4), those that fit in the cluster's
  CPUs), all capped by `--max-world-size`; message sizes x4 from 1 KiB up to the job's gradient
  bytes (capped at 4 MiB on gloo, 1 GiB on NCCL).
- Placement: one placement group of `max(world sizes)` bundles, strategy PACK (a node is filled
  before the next, so a small group measures the intra-node link first). The same actors serve
  every world size: world size n uses ranks 0..n-1. On NCCL the actors of one node all see that
  node's group GPUs (CUDA_VISIBLE_DEVICES shared, as Ray Train does): NCCL's P2P/NVLS paths
  misbehave when every process masks all GPUs but its own.
- Rendezvous: rank 0 hosts a `torch.distributed.TCPStore` on a port the OS picks, at 127.0.0.1
  with gloo's and NCCL's sockets kept on loopback when all ranks share a node (as in
  `profiler.comm`), else at rank 0's node IP.
- Timing: `profiler.comm.all_reduce_sweep`, the very code of the local benchmark: an iteration's
  time is the max over ranks; per (world size, message size) median, p10, p90 and count.

The record has the JSON shape of `python -m profiler.comm --out` (so `comm_fit` and the planner
treat it the same), plus `"launcher": "ray_actors"`, the `node_ids` of the ranks and, per world size,
a `groups` entry (rendezvous address, node and device of every rank).

Failures: a rank that raises (forming the group, or in a collective) makes a "failed" record: the
point's own error, as in `profiler.comm`. An actor that dies, a placement group the cluster has no
room for within PLACEMENT_TIMEOUT_S, or a run past its deadline raises `GroupLost`: the attempt is
lost and the executor retries the point. The actors are killed and the placement group removed in
every case.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from profiler import comm

LAUNCHER = "ray_actors"
CPU_PER_RANK = 0.45  # gloo ranks mostly wait on sockets: 4 ranks and the coordinator fit on 2 CPUs
PLACEMENT_TIMEOUT_S = 300.0
PEER_GRACE_S = 5.0  # after a rank raises: time for a peer's death to surface as the real cause
ERROR_TAIL_CHARS = 4000
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class GroupLost(RuntimeError):
    """An actor died, the placement never became ready, or time ran out: the attempt is lost."""


@ray.remote(max_restarts=0)
class CommRank:
    """One rank of the group: joins a process group, runs the sweep, leaves it."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None
        self._cluster_env = {name: os.environ.get(name) for name in SOCKET_IFNAME_VARS}

    def where(self) -> dict[str, Any]:
        """Where this rank runs; touches no CUDA (the visible devices may still change)."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(gpu_id) for gpu_id in ray.get_gpu_ids()],
        }

    def see_devices(self, cuda_visible_devices: str) -> None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices

    def host_store(self, host: str, world_size: int, timeout_s: float) -> int:
        """Rank 0: serve the rendezvous store; returns its port (picked by the OS: no port race)."""
        self._store = dist.TCPStore(host, 0, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        return self._store.port

    def run(
        self, backend: str, host: str, port: int, rank: int, world_size: int, local_device: int,
        sizes: list[int], policy: comm.CommPolicy, timeout_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        self._use_sockets_for(host)
        torch.set_num_threads(1)  # ranks may share a node's cores; no intra-op threads on top
        device = torch.device("cuda", local_device) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        try:
            store = self._store if rank == 0 else dist.TCPStore(host, port, world_size, False, timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )  # fmt: skip
            points = comm.all_reduce_sweep(rank, world_size, device, sizes, policy)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None
        return {"points": points, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    def _use_sockets_for(self, host: str) -> None:
        """Loopback for a one-node group (as profiler.comm); the cluster's own settings otherwise."""
        if host == comm.LOOPBACK_HOST:
            names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
            for variable in SOCKET_IFNAME_VARS:
                os.environ[variable] = names[0] if names else "lo"
            return
        for variable, value in self._cluster_env.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def measure_on_actors(
    comm_args: Sequence[str],
    timeout_s: float,
    placement_group_name: str = "",
    cpu_per_rank: float = CPU_PER_RANK,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
    policy: comm.CommPolicy = comm.CommPolicy(),
) -> dict[str, Any]:
    """Run the benchmark that `python -m profiler.comm *comm_args` would run, across Ray actors.

    Call it inside a Ray task (it uses the connected cluster). `timeout_s` bounds everything after
    the placement is ready; `--timeout-s` in `comm_args` bounds each world size. Returns the record
    ("ok" or "failed"); raises GroupLost when the attempt is lost (module docstring).
    """
    started = time.perf_counter()
    try:
        args = comm.build_parser().parse_args(list(comm_args))
    except SystemExit:
        record = comm.new_record(0, None, "auto", None, policy)
        record.update(launcher=LAUNCHER, node_ids=[], groups=[], status="failed",
                      error=f"ValueError: bad profiler.comm arguments {list(comm_args)}", elapsed_s=0.0)  # fmt: skip
        return record
    record = comm.new_record(args.max_bytes, args.world_sizes, args.backend, args.message_bytes_cap, policy)
    record.update(launcher=LAUNCHER, node_ids=[], groups=[])
    group: _ActorGroup | None = None
    world_size = None
    try:
        resources = ray.cluster_resources()
        cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), float(resources.get("CPU", 0))
        record["backend"] = backend = comm.resolve_backend(args.backend, cuda_devices=cluster_gpus)
        record.update(_describe(backend))
        cap = args.message_bytes_cap or (comm.CUDA_MESSAGE_BYTES_CAP if backend == "nccl" else comm.CPU_MESSAGE_BYTES_CAP)
        record["message_bytes_cap"] = cap
        sizes = comm.message_sizes(min(int(args.max_bytes), cap))
        if backend == "nccl":
            limit, reason = cluster_gpus, f"one Ray actor per GPU, {cluster_gpus} GPUs in the cluster"
        else:
            limit = min(comm.CPU_MAX_WORLD_SIZE, int(cluster_cpus / cpu_per_rank))
            reason = f"Ray actors of {cpu_per_rank:g} CPU, {cluster_cpus:g} CPUs in the cluster"
        record["world_sizes"] = planned = comm.plan_world_sizes(backend, args.world_sizes, args.max_world_size, limit, reason)
        group = _ActorGroup(max(planned), backend, cpu_per_rank, placement_group_name)
        group.start(placement_timeout_s)
        deadline = time.monotonic() + timeout_s
        group.locate(deadline, timeout_s)
        record["node_ids"] = sorted({place["node_id"] for place in group.places})
        for world_size in planned:
            world_deadline = min(deadline, time.monotonic() + args.timeout_s)
            result = group.run(world_size, sizes, policy, world_deadline, min(timeout_s, args.timeout_s))
            record["points"].extend(result["points"])
            record["groups"].append(result["group"])
            record["device"] = result["device"]
    except comm.RankFailure as error:
        where = f"world size {world_size}: " if world_size else ""
        record.update(status="failed", error=f"RankFailure: {where}{error}")
    except GroupLost:
        raise
    except Exception as error:  # noqa: BLE001 - a failed benchmark is data for the caller
        record.update(status="failed", error=f"{type(error).__name__}: {error}")
    finally:
        if group is not None:
            group.close()
    record["elapsed_s"] = time.perf_counter() - started
    return record


class _ActorGroup:
    """The placement group and its actors, one per rank; `close` kills them whatever happened."""

    def __init__(self, size: int, backend: str, cpu_per_rank: float, name: str):
        self.size, self.backend, self.cpu_per_rank = size, backend, cpu_per_rank
        self.bundle = {"GPU": 1} if backend == "nccl" else {"CPU": cpu_per_rank}
        self.placement = placement_group([self.bundle] * size, strategy="PACK", name=name)
        self.actors: list = []
        self.places: list[dict[str, Any]] = []
        self.local_devices = [0] * size

    def start(self, placement_timeout_s: float) -> None:
        """Wait for the cluster to reserve every rank's bundle, then start one actor per bundle."""
        ready, _ = ray.wait([self.placement.ready()], timeout=placement_timeout_s)
        if not ready:
            raise GroupLost(f"the cluster had no room for {self.size} ranks of {self.bundle} within {placement_timeout_s:g} s")
        nccl = self.backend == "nccl"
        self.actors = [
            CommRank.options(
                num_cpus=0 if nccl else self.cpu_per_rank,
                num_gpus=1 if nccl else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index),
            ).remote()
            for index in range(self.size)
        ]  # fmt: skip

    def locate(self, deadline: float, timeout_s: float) -> None:
        """Learn every rank's node; on NCCL, let the ranks of a node see all of its group GPUs."""
        self.places = _gather([actor.where.remote() for actor in self.actors], deadline, timeout_s, "start-up")
        if self.backend != "nccl":
            return
        node_gpus: dict[str, set[str]] = {}
        for place in self.places:
            node_gpus.setdefault(place["node_id"], set()).update(place["gpu_ids"])
        visible = {node: sorted(ids, key=lambda gpu_id: (len(gpu_id), gpu_id)) for node, ids in node_gpus.items()}
        calls = []
        for rank, (actor, place) in enumerate(zip(self.actors, self.places, strict=True)):
            ids = visible[place["node_id"]]
            if place["gpu_ids"]:
                self.local_devices[rank] = ids.index(place["gpu_ids"][0])
                calls.append(actor.see_devices.remote(",".join(ids)))
        _gather(calls, deadline, timeout_s, "device set-up")

    def run(self, world_size: int, sizes: list[int], policy: comm.CommPolicy, deadline: float, timeout_s: float) -> dict:
        ranks = range(world_size)
        places = self.places[:world_size]
        one_node = len({place["node_id"] for place in places}) == 1
        host = comm.LOOPBACK_HOST if one_node else places[0]["ip"]
        [port] = _gather([self.actors[0].host_store.remote(host, world_size, timeout_s)], deadline, timeout_s, "rendezvous")
        results = _gather(
            [
                self.actors[rank].run.remote(
                    self.backend, host, port, rank, world_size, self.local_devices[rank], sizes, policy, timeout_s
                )
                for rank in ranks
            ],
            deadline, timeout_s, f"world size {world_size}",
        )  # fmt: skip
        group = {
            "world_size": world_size,
            "rendezvous": f"tcp://{host}:{port}",
            "ranks": [
                {"rank": rank, "node_id": places[rank]["node_id"], "hostname": places[rank]["hostname"],
                 "device": results[rank]["device"]}
                for rank in ranks
            ],
        }  # fmt: skip
        return {"points": results[0]["points"], "device": results[0]["device"], "group": group}

    def close(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        try:
            remove_placement_group(self.placement)
        except Exception:  # noqa: BLE001 - already removed
            pass


def _gather(refs: list, deadline: float, timeout_s: float, phase: str) -> list[Any]:
    """Every rank's result in rank order. A dead actor or the deadline raises GroupLost; a rank that
    raised raises RankFailure, unless a peer turns out to have died (then that is the cause)."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            ranks = sorted(rank_of[ref] for ref in pending)
            raise GroupLost(f"{phase}: timed out after {timeout_s:g} s; ranks {ranks} had not finished")
        for ref in ready:
            try:
                results[rank_of[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                raise GroupLost(f"{phase}: rank {rank_of[ref]} died: {_tail(error)}") from None
            except ray.exceptions.RayTaskError as error:
                _raise_if_a_peer_died(pending, rank_of, phase)
                raise comm.RankFailure(f"rank {rank_of[ref]} failed during {phase}:\n{_tail(error)}") from None
            except ray.exceptions.RayError as error:
                raise GroupLost(f"{phase}: rank {rank_of[ref]} lost: {_tail(error)}") from None
    return results


def _raise_if_a_peer_died(pending: list, rank_of: dict, phase: str) -> None:
    if not pending:
        return
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as error:
            raise GroupLost(f"{phase}: rank {rank_of[ref]} died: {_tail(error)}") from None
        except ray.exceptions.RayError:
            pass


def _tail(error: BaseException) -> str:
    return str(error)[-ERROR_TAIL_CHARS:].strip()


def _describe(backend: str) -> dict[str, str]:
    if backend == "nccl":
        return {
            "timing": "cuda_events",
            "measured": "NCCL all-reduce (SUM, float32) between Ray actors, one per GPU, packed onto as few nodes "
            "as the cluster allows",
            "informs_network_model": True,
        }
    return {
        "device": "cpu",
        "timing": "perf_counter",
        "measured": "gloo all-reduce (SUM, float32) between CPU Ray actors over TCP (loopback when they share a "
        "node); memory copies and the TCP stack, not a GPU interconnect",
        "informs_network_model": False,
    }
