"""How long does a newcomer wait for the first recommendation of `make run`?

Starts `tula serve` as `make run` does: a fresh SQLite file (in a temporary folder), the local
executor, `--seed-example configs/example_small_cnn.yaml`, on a free loopback port. The clock starts
just before the server process is launched, so the server's own start (imports, migrations) and the
profiling workers' start (importing torch) count. It polls GET /v1/jobs until the seeded job exists,
then GET /v1/jobs/{id}/recommendation once a second until it answers 200 (the job itself every
STATE_EVERY polls, to stop on a failed job), and stops the server. Once a second is the load of
`tula`'s own client waiting on a job (`TulaClient.wait`). Every request the server answers takes a
core from the point being timed on a 2-core host: the iterations it interrupts wait 3-10x longer.
Those few slow iterations once re-timed 4 or 5 of the 5 points (32 to 37 s), when a point was judged
by std / mean; judged by its robust CV and stopped once its median is known to 1%, a run re-times 0
to 2 points.

Each run prints its time, where it went (read from the server's lifecycle log lines: when the example
job was seeded, when the warm worker had imported torch and how long that took, when the first point
started), the 1-minute load average before and after (other work on the host slows every point and
makes noisy points that are re-timed), and the job's points with their durations; the last line is
the median over --runs (3):

    first_answer: seconds_to_recommendation=X points=N

Nothing is written outside a temporary folder (the server's log is printed when a run fails).

Run: .venv/bin/python benchmarks/first_answer.py [--runs 3] [--quick] [--timeout-s 600]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import REPO, api_server  # noqa: E402

EXAMPLE = REPO / "configs" / "example_small_cnn.yaml"
POLL_S = 1.0  # as TulaClient.wait: more often would compete with the points for the CPU
STATE_EVERY = 5  # polls of the recommendation per read of the job's state
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO tula\.lifecycle: event=(\w+)(.*)$")
MILESTONES = {"job_submitted": "job seeded", "warm_worker_started": "warm worker ready", "point_started": "first point started"}


def _get(url: str) -> httpx.Response | None:
    """The answer, or None for a transport error or a 5xx (e.g. a database busy with the seeding)."""
    try:
        response = httpx.get(url, timeout=10)
    except httpx.TransportError:
        return None
    return None if response.status_code >= 500 else response


def _seeded_job_id(url: str) -> str | None:
    response = _get(f"{url}/v1/jobs")
    jobs = response.json().get("jobs") if response is not None and response.status_code == 200 else None
    return jobs[0]["id"] if jobs else None


def milestones(log_text: str, launched_at: dt.datetime) -> str:
    """"job seeded 5.1 s, warm worker ready 9.0 s (preload 3.8 s), ...": the first line of each
    MILESTONES event, in seconds since the launch (the log's timestamps are local wall-clock time)."""
    seen: dict[str, str] = {}
    for line in log_text.splitlines():
        match = LOG_LINE.match(line)
        if match and match[2] in MILESTONES and match[2] not in seen:
            at_s = (dt.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f") - launched_at).total_seconds()
            preload = re.search(r" preload_s=([\d.]+)", match[3])
            seen[match[2]] = f"{MILESTONES[match[2]]} {at_s:.1f} s" + (f" (preload {float(preload[1]):.1f} s)" if preload else "")
    return ", ".join(seen[event] for event in MILESTONES if event in seen)


def one_run(timeout_s: float) -> tuple[float, dict, str]:
    """Seconds from launching the server to the seeded job's recommendation, the job, and where the
    time went (`milestones`)."""
    with tempfile.TemporaryDirectory(prefix="tula-first-answer-") as folder:
        log_path = Path(folder) / "server.log"
        launched_at = dt.datetime.now()
        started = time.monotonic()
        extra_args = ["--seed-example", str(EXAMPLE)]
        with api_server(None, log_path, executor="local", extra_args=extra_args) as (url, _database_url):
            deadline = started + timeout_s
            job_id, polls = None, 0
            while time.monotonic() < deadline:
                job_id = job_id or _seeded_job_id(url)
                answer = _get(f"{url}/v1/jobs/{job_id}/recommendation") if job_id else None
                if answer is not None and answer.status_code == 200:
                    seconds = time.monotonic() - started
                    job = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()
                    return seconds, job, milestones(log_path.read_text(), launched_at)
                polls += bool(job_id)
                job = _get(f"{url}/v1/jobs/{job_id}") if job_id and polls % STATE_EVERY == 0 else None
                if job is not None and job.status_code == 200 and job.json()["state"] in ("failed", "cancelled"):
                    raise RuntimeError(f"the example job ended {job.json()['state']}: {job.json().get('error')}\n{log_path.read_text()}")
                time.sleep(POLL_S)
            raise RuntimeError(f"no recommendation within {timeout_s:g} s:\n{log_path.read_text()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh servers to time; the median is reported")
    parser.add_argument("--quick", action="store_true", help="one run")
    parser.add_argument("--timeout-s", type=float, default=600, help="give up on a run after this long")
    args = parser.parse_args(argv)
    runs = 1 if args.quick else args.runs

    seconds, points = [], 0
    for index in range(runs):
        load_before = os.getloadavg()[0]
        elapsed_s, job, where = one_run(args.timeout_s)
        seconds.append(elapsed_s)
        points = len(job["points"])
        durations = ", ".join(
            f"{p['kind']} {p['batch_size'] or ''} {p['state']} {p['duration_s'] or 0:.1f}s".replace("  ", " ")
            for p in job["points"]
        )  # fmt: skip
        load = f"load {load_before:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
        print(f"run {index + 1}/{runs}: {elapsed_s:.1f} s to the recommendation ({where}; {load}); "
              f"points: {durations}", flush=True)
    print(f"first_answer: seconds_to_recommendation={statistics.median(seconds):.1f} points={points}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
