"""How long does a newcomer wait for the first recommendation of `make run`?

Starts `tula serve` as `make run` does: a fresh SQLite file (in a temporary folder), the local
executor, `--seed-example configs/example_small_cnn.yaml`, on a free loopback port. The clock starts
just before the server process is launched, so the server's own start (imports, migrations) and the
profiling workers' start (importing torch) count. It polls GET /v1/jobs until the seeded job exists,
then GET /v1/jobs/{id}/recommendation until it answers 200, and stops the server.

Each run prints its time, the job's points and their durations; the last line is the median over
--runs (3):

    first_answer: seconds_to_recommendation=X points=N

Nothing is written outside a temporary folder (the server's log is printed when a run fails).

Run: .venv/bin/python benchmarks/first_answer.py [--runs 3] [--quick] [--timeout-s 600]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import REPO, api_server  # noqa: E402

EXAMPLE = REPO / "configs" / "example_small_cnn.yaml"
POLL_S = 1.0  # each poll reads the job (its measurements too): more often would compete with the points for the CPU


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


def one_run(timeout_s: float) -> tuple[float, dict]:
    """Seconds from launching the server to the seeded job's recommendation, and the job."""
    with tempfile.TemporaryDirectory(prefix="tula-first-answer-") as folder:
        log_path = Path(folder) / "server.log"
        started = time.monotonic()
        extra_args = ["--seed-example", str(EXAMPLE)]
        with api_server(None, log_path, executor="local", extra_args=extra_args) as (url, _database_url):
            deadline = started + timeout_s
            job_id = None
            while time.monotonic() < deadline:
                job_id = job_id or _seeded_job_id(url)
                answer = _get(f"{url}/v1/jobs/{job_id}/recommendation") if job_id else None
                if answer is not None and answer.status_code == 200:
                    seconds = time.monotonic() - started
                    return seconds, httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()
                job = _get(f"{url}/v1/jobs/{job_id}") if job_id else None
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
        elapsed_s, job = one_run(args.timeout_s)
        seconds.append(elapsed_s)
        points = len(job["points"])
        durations = ", ".join(
            f"{p['kind']} {p['batch_size'] or ''} {p['state']} {p['duration_s'] or 0:.1f}s".replace("  ", " ")
            for p in job["points"]
        )  # fmt: skip
        print(f"run {index + 1}/{runs}: {elapsed_s:.1f} s to the recommendation; points: {durations}", flush=True)
    print(f"first_answer: seconds_to_recommendation={statistics.median(seconds):.1f} points={points}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
