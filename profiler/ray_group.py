"""The all-reduce benchmark of `profiler.comm`, and the data-parallel step of `profiler.ddp_step`, run across a
group of Ray actors.

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

The step (`measure_step_on_actors`, a step point whose placement spans nodes): a bundle per node of the
placement holding that node's ranks, strategy STRICT_SPREAD (every bundle on a node of its own), the same
actors, rendezvous and NCCL device set-up; each rank runs `profiler.ddp_step.rank_step`, so the record is
the one-node step's (kind "step") with launcher "ray_actors", the ranks' `node_ids` and the `group`.

Failures: a rank that raises (forming the group, or in a collective) makes a "failed" record: the
point's own error, as in `profiler.comm` (a step raises comm.RankFailure, or gives status "oom" when a rank
ran out of memory). An actor that dies, a placement group the cluster has no
room for within PLACEMENT_TIMEOUT_S, or a run past its deadline raises `GroupLost`: the attempt is
lost and the executor retries the point. The actors are killed and the placement group removed in
every case.
"""

from __future__ import annotations

import contextlib
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

from profiler import comm, ddp_step
from profiler.measure import is_out_of_memory

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
        with self._joined(backend, host, port, rank, world_size, local_device, timeout_s) as device:
            points = comm.all_reduce_sweep(rank, world_size, device, sizes, policy)
        return {"points": points, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    def run_step(
        self, backend: str, host: str, port: int, rank: int, world_size: int, local_device: int,
        request: dict[str, Any], remaining_s: float, timeout_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        """This rank's part of a data-parallel step (`profiler.ddp_step.rank_step`); the time cap counts on this
        actor's own clock (nodes' monotonic clocks differ)."""
        deadline_s = time.monotonic() + remaining_s
        warmup_iters, wanted_iters, _ = ddp_step.timed_iterations(request)
        with self._joined(backend, host, port, rank, world_size, local_device, timeout_s) as device:
            return ddp_step.rank_step(rank, world_size, device, request, warmup_iters, wanted_iters, deadline_s)

    @contextlib.contextmanager
    def _joined(self, backend: str, host: str, port: int, rank: int, world_size: int, local_device: int, timeout_s: float):
        """This actor in the group's process group (rank 0 serving the store it hosts), left on the way out."""
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
            yield device
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None

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


def measure_step_on_actors(
    request: dict[str, Any],
    timeout_s: float,
    placement_group_name: str = "",
    cpu_per_rank: float = CPU_PER_RANK,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
) -> dict[str, Any]:
    """A data-parallel training step on request["placement"] (the GPUs used on each node, e.g. [2, 2]) across Ray
    actors: one per GPU with NCCL when the cluster has GPUs (and the request's device is not "cpu"), else gloo CPU
    actors of `cpu_per_rank`; a bundle per node, each on a node of its own (STRICT_SPREAD), so [1, 1] is measured
    across two nodes. Each rank runs `profiler.ddp_step.rank_step`, the code of the one-node step; the time cap
    counts from when the group has formed.

    Call it inside a Ray task. Returns the step record (`profiler.ddp_step`'s fields, launcher "ray_actors", the
    ranks' `node_ids` and the `group`): "ok", or "oom" when a rank ran out of memory. A rank's other failure raises
    comm.RankFailure; a lost actor, no room for the bundles or the deadline raise GroupLost."""
    started = time.monotonic()
    placement = [int(gpus) for gpus in request["placement"]]
    gpus = int(ray.cluster_resources().get("GPU", 0))
    backend = "nccl" if gpus and request.get("device", "auto") != "cpu" else "gloo"
    base = ddp_step.record_base(placement, int(request["batch_size"]), backend, LAUNCHER)
    _, _, time_cap_s = ddp_step.timed_iterations(request)
    group = _ActorGroup(sum(placement), backend, cpu_per_rank, placement_group_name, nodes=placement)
    try:
        group.start(placement_timeout_s)
        deadline = time.monotonic() + timeout_s
        group.locate(deadline, timeout_s)
        ranks = group.run_step(request, time_cap_s, deadline, timeout_s)
    except comm.RankFailure as error:
        if not is_out_of_memory(error):
            raise
        return {**base, "status": "oom", "error": ddp_step.last_line(error), "elapsed_s": time.monotonic() - started}
    finally:
        group.close()
    record = ddp_step.finished_record(base, ranks[0], request, time.monotonic() - started)
    return {**record, "node_ids": sorted({place["node_id"] for place in group.places}), "group": group.group}


class _ActorGroup:
    """The placement group and its actors, one per rank; `close` kills them whatever happened."""

    def __init__(self, size: int, backend: str, cpu_per_rank: float, name: str, nodes: list[int] | None = None):
        """`size` ranks packed onto as few nodes as the cluster allows (a bundle each); or, with `nodes` (the ranks
        on each node, e.g. [2, 2]), a bundle per node holding that node's ranks, each bundle on its own node."""
        self.size, self.backend, self.cpu_per_rank = size, backend, cpu_per_rank
        self.bundle = {"GPU": 1} if backend == "nccl" else {"CPU": cpu_per_rank}
        if nodes is None:
            bundles, strategy, self.bundle_of_rank = [self.bundle] * size, "PACK", list(range(size))
        else:
            bundles = [{key: value * ranks for key, value in self.bundle.items()} for ranks in nodes]
            strategy = "STRICT_SPREAD" if len(nodes) > 1 else "PACK"
            self.bundle_of_rank = [node for node, ranks in enumerate(nodes) for _ in range(ranks)]
        self.bundles = bundles
        self.placement = placement_group(bundles, strategy=strategy, name=name)
        self.actors: list = []
        self.places: list[dict[str, Any]] = []
        self.local_devices = [0] * size

    def start(self, placement_timeout_s: float) -> None:
        """Wait for the cluster to reserve every rank's bundle, then start one actor per bundle."""
        ready, _ = ray.wait([self.placement.ready()], timeout=placement_timeout_s)
        if not ready:
            raise GroupLost(f"the cluster had no room for the bundles {self.bundles} within {placement_timeout_s:g} s")
        nccl = self.backend == "nccl"
        self.actors = [
            CommRank.options(
                num_cpus=0 if nccl else self.cpu_per_rank,
                num_gpus=1 if nccl else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=self.bundle_of_rank[index]),
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

    def rendezvous(self, world_size: int, deadline: float, timeout_s: float) -> tuple[str, int]:
        """(host, port) of the store rank 0 serves: loopback when the first `world_size` ranks share a node."""
        one_node = len({place["node_id"] for place in self.places[:world_size]}) == 1
        host = comm.LOOPBACK_HOST if one_node else self.places[0]["ip"]
        [port] = _gather([self.actors[0].host_store.remote(host, world_size, timeout_s)], deadline, timeout_s, "rendezvous")
        return host, port

    def describe(self, world_size: int, host: str, port: int, devices: list[str]) -> dict[str, Any]:
        return {
            "world_size": world_size,
            "rendezvous": f"tcp://{host}:{port}",
            "ranks": [
                {"rank": rank, "node_id": self.places[rank]["node_id"], "hostname": self.places[rank]["hostname"], "device": devices[rank]}
                for rank in range(world_size)
            ],
        }  # fmt: skip

    def run_step(self, request: dict[str, Any], remaining_s: float, deadline: float, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's `ddp_step.rank_step` timings, in rank order."""
        host, port = self.rendezvous(self.size, deadline, timeout_s)
        calls = [
            actor.run_step.remote(self.backend, host, port, rank, self.size, self.local_devices[rank], request, remaining_s, timeout_s)
            for rank, actor in enumerate(self.actors)
        ]  # fmt: skip
        results = _gather(calls, deadline, timeout_s, "the step")
        self.group = self.describe(self.size, host, port, [result["device"] for result in results])
        return results

    def run(self, world_size: int, sizes: list[int], policy: comm.CommPolicy, deadline: float, timeout_s: float) -> dict:
        ranks = range(world_size)
        host, port = self.rendezvous(world_size, deadline, timeout_s)
        results = _gather(
            [
                self.actors[rank].run.remote(
                    self.backend, host, port, rank, world_size, self.local_devices[rank], sizes, policy, timeout_s
                )
                for rank in ranks
            ],
            deadline, timeout_s, f"world size {world_size}",
        )  # fmt: skip
        group = self.describe(world_size, host, port, [result["device"] for result in results])
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
