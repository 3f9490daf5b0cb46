"""Does the API keep every job under concurrent submissions, and how fast does it answer?

Starts `python -m tula_service serve --executor none` (API only: jobs are stored, never profiled) on
a free loopback port with its own SQLite file in a temporary folder, or on --database-url (e.g.
`postgresql+psycopg://user@127.0.0.1:5432/tula_bench`, a database the benchmark may fill); or uses
the server at --url. Then, with httpx on asyncio:

- submits --jobs (200) small valid specs, at most --concurrency (32) at a time, each with its own
  Idempotency-Key, each followed by a read of its own job (GET /v1/jobs/{id});
- meanwhile --readers (8) clients loop over GET /v1/jobs/{some submitted id} and
  GET /v1/jobs?limit=20 until the submissions are done;
- afterwards reads every submitted job back (GET /v1/jobs/{id}: 200, same id, same name) and
  compares the growth of `total` in GET /v1/jobs with the number submitted.

Every request is timed (wall clock, client side, loopback). It prints count, errors, p50, p99 and
max per request kind, and as the last line

    api_load: submitted=N persisted=N p50_ms=X p99_ms=Y errors=E

where p50/p99 are over all requests (the read-back included) and errors counts non-2xx answers and
transport errors. It exits 1 when a submitted job is missing, the total did not grow by N, or any
request failed.

Run: .venv/bin/python benchmarks/api_load.py [--jobs 200] [--concurrency 32] [--readers 8]
                                             [--database-url URL | --url http://HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import api_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LIST_PAGE = 20
KINDS = ("submit", "get", "list", "read_back")


def job_spec(index: int) -> dict:
    """A small valid spec (never profiled under --executor none): the catalog A10G, its price."""
    return {
        "name": f"api-load-{index}",
        "model": "small_cnn",
        "dataset": {"name": "synthetic_images", "num_samples": 1000},
        "batch_sizes": [8, 16],
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "a10g"},
        "pricing": {"kind": "gpu_hour"},
        "training": {"reference_batch": 16, "reference_epochs": 1},
    }


@dataclass
class Timings:
    """Latency (ms) of every request by kind; failures by kind with a sample of what went wrong."""

    latency_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    samples: list[str] = field(default_factory=list)

    async def request(self, client: httpx.AsyncClient, kind: str, method: str, path: str, **kwargs) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.TransportError as error:
            self._failed(kind, f"{method} {path}: {type(error).__name__}: {error}")
            return None
        finally:
            self.latency_ms[kind].append((time.perf_counter() - started) * 1000)
        if not response.is_success:
            self._failed(kind, f"{method} {path}: {response.status_code} {response.text[:200]}")
        return response

    def _failed(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.samples) < 5:
            self.samples.append(what)

    def all_ms(self) -> np.ndarray:
        return np.concatenate([np.asarray(values) for values in self.latency_ms.values()]) if self.latency_ms else np.zeros(0)


async def submit_and_read(client, timings, index, submitted_ids, limit):
    async with limit:
        response = await timings.request(
            client, "submit", "POST", "/v1/jobs", json=job_spec(index), headers={"Idempotency-Key": uuid.uuid4().hex}
        )
        if response is None or response.status_code != 202:
            return None
        job_id = response.json()["id"]
        submitted_ids.append(job_id)
        await timings.request(client, "get", "GET", f"/v1/jobs/{job_id}")
        return job_id


async def reader(client, timings, submitted_ids, done: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not done.is_set():
        if submitted_ids and rng.random() < 0.5:
            await timings.request(client, "get", "GET", f"/v1/jobs/{rng.choice(submitted_ids)}")
        else:
            await timings.request(client, "list", "GET", "/v1/jobs", params={"limit": LIST_PAGE})


async def total_jobs(client: httpx.AsyncClient) -> int:
    response = await client.get("/v1/jobs", params={"limit": 1})
    response.raise_for_status()
    return int(response.json()["total"])


async def read_back(client, timings, index: int, job_id: str, limit) -> bool:
    async with limit:
        response = await timings.request(client, "read_back", "GET", f"/v1/jobs/{job_id}")
    if response is None or response.status_code != 200:
        return False
    body = response.json()
    return body["id"] == job_id and body["name"] == f"api-load-{index}"


async def run_load(url: str, jobs: int, concurrency: int, readers: int) -> tuple[Timings, int, int, int]:
    """(timings, persisted, total before, total after)"""
    timings = Timings()
    limits = httpx.Limits(max_connections=concurrency + readers, max_keepalive_connections=concurrency + readers)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        total_before = await total_jobs(client)
        submitted_ids: list[str] = []
        done = asyncio.Event()
        limit = asyncio.Semaphore(concurrency)
        reading = [asyncio.create_task(reader(client, timings, submitted_ids, done, seed)) for seed in range(readers)]
        job_ids = await asyncio.gather(*(submit_and_read(client, timings, i, submitted_ids, limit) for i in range(jobs)))
        done.set()
        await asyncio.gather(*reading)
        found = await asyncio.gather(
            *(read_back(client, timings, i, job_id, limit) for i, job_id in enumerate(job_ids) if job_id is not None)
        )
        total_after = await total_jobs(client)
    return timings, sum(found), total_before, total_after


def report(timings: Timings, jobs: int, persisted: int, total_growth: int, elapsed_s: float, database: str) -> int:
    errors = sum(timings.errors.values())
    every = timings.all_ms()
    print(f"database: {database}   wall: {elapsed_s:.1f} s   requests: {every.size} ({every.size / elapsed_s:.0f}/s)")
    print(f"{'kind':<10} {'count':>6} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for kind in KINDS:
        values = np.asarray(timings.latency_ms.get(kind, []))
        if values.size:
            p50, p99 = np.percentile(values, [50, 99])
            print(f"{kind:<10} {values.size:>6} {timings.errors[kind]:>6} {p50:>8.1f} {p99:>8.1f} {values.max():>8.1f}")
    for sample in timings.samples:
        print(f"error: {sample}")
    if total_growth != jobs:
        print(f"GET /v1/jobs total grew by {total_growth}, not by the {jobs} submitted")
    p50, p99 = np.percentile(every, [50, 99]) if every.size else (float("nan"), float("nan"))
    print(f"api_load: submitted={jobs} persisted={persisted} p50_ms={p50:.1f} p99_ms={p99:.1f} errors={errors}")
    return 0 if persisted == jobs and total_growth == jobs and errors == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="job submissions (default 200)")
    parser.add_argument("--concurrency", type=int, default=32, help="submissions in flight at once (default 32)")
    parser.add_argument("--readers", type=int, default=8, help="concurrent readers during the submissions (default 8)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="a running server (its jobs are counted, not cleared)")
    target.add_argument("--database-url", help="start the server on this database instead of a fresh SQLite file")
    args = parser.parse_args(argv)
    if min(args.jobs, args.concurrency) < 1 or args.readers < 0:
        parser.error("--jobs and --concurrency must be >= 1, --readers >= 0")
    log_path = Path(tempfile.gettempdir()) / "tula-api-load-server.log"

    def measure(url: str, database: str) -> int:
        started = time.monotonic()
        timings, persisted, before, after = asyncio.run(run_load(url, args.jobs, args.concurrency, args.readers))
        return report(timings, args.jobs, persisted, after - before, time.monotonic() - started, database)

    if args.url:
        return measure(args.url.rstrip("/"), f"behind {args.url}")
    with api_server(args.database_url, log_path) as (url, database_url):
        print(f"server: {url} (log: {log_path})")
        return measure(url, database_url.split("@")[-1] if "@" in database_url else database_url)


if __name__ == "__main__":
    sys.exit(main())
