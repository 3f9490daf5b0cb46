"""Hand-made measurements with known parameters, shaped like the profiler's JSON: the spec and the
compute points come from `benchmarks.handmade_measurements` (a benchmark uses them too); the records
only the tests need are here."""

from __future__ import annotations

from typing import Any

from benchmarks.handmade_measurements import measurement, spec_dict

__all__ = ["comm_record", "measurement", "oom", "spec_dict"]  # measurement and spec_dict: re-exported for the tests


def oom(batch_size: int) -> dict[str, Any]:
    return {"schema_version": 2, "kind": "compute", "status": "oom", "batch_size": batch_size, "error": "out of memory"}


def comm_record(backend: str, latency_s: float, bandwidth_gbps: float) -> dict[str, Any]:
    """An exact all-reduce benchmark record of a ring with the given link (profiler.comm's format)."""
    points = []
    for world_size in (2, 4):
        for message_bytes in (1024, 65536, 4 * 2**20):
            hops = 2 * (world_size - 1)
            seconds = hops * latency_s + hops / world_size * message_bytes * 8 / (bandwidth_gbps * 1e9)
            points.append({"world_size": world_size, "message_bytes": message_bytes, "median_s": seconds, "count": 10})
    return {"schema_version": 1, "kind": "comm", "status": "ok", "backend": backend, "device": "x", "points": points}
