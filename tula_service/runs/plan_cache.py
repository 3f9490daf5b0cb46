"""GET /v1/runs/{id}/plan answered again without re-planning when nothing it rests on has changed.

Re-planning fits every model and sweeps the candidates: 110-220 ms of a server core per answer, where an answer
kept costs 3-10 ms and a 304 3-7 ms (a real server on SQLite, the tests' hand-made job with 200 and 3 000
telemetry records, one HTTP client kept open, medians of 10, this repository's 2-core CPU; one-off check). A training loop asks every `plan_every_s`, a
dashboard on every click, an orchestrator on its own clock, and most of those questions come between two posts of
telemetry, when the answer cannot differ: `tula_service.runs.replan.advise` is a function of the job (its spec and
measurements) and of the run (options, configuration, telemetry, last step), and of nothing else (no clock).

- The version of a run's plan (`plan_version`) names those inputs: the run's telemetry only grows and is stored
  once per step, so its count with the last step names it; the configuration, the options and the decisions are
  compared whole; the job by its state, its update time and its points' states and attempts. The server's boot id is in it too, so that an upgrade or
  a restart never serves an answer that other code computed.
- The version is the answer's ETag. A client that sends it back (If-None-Match) gets 304 Not Modified, no body,
  before the job's measurements are read or anything is fitted; a browser's fetch does that by itself (Cache-Control: no-cache).
- Answers are kept in memory (`PlanCache`, the latest of PLAN_CACHE_RUNS runs), only those that moved nothing:
  an answer that recorded a change moved the run to a new version, whose own answer (changed: false) is computed
  once more. Several server processes each keep their own; none can serve a stale answer, as the version is read
  from the database on every request.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import uuid
from typing import Any

PLAN_CACHE_RUNS = 256
BOOT_ID = uuid.uuid4().hex  # this server process: versions computed by other code never match


def plan_version(run: Any, job: Any) -> str:
    """A quoted ETag naming everything the run's advice is computed from."""
    named = {
        "boot": BOOT_ID,
        "run": [run.id, run.records, run.last_step, run.config, run.options, run.decisions],
        "job": [job.id, job.state, job.updated_at, sorted((p.id, p.state, p.attempts) for p in job.points)],
    }
    digest = hashlib.sha256(json.dumps(named, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return f'"{digest}"'


def matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match header names `etag` (a list of tags, `*`, or weak W/ tags, RFC 9110 13.1.2)."""
    if not if_none_match:
        return False
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return "*" in tags or etag in tags


class PlanCache:
    """The latest answer per run, with its version; thread-safe (FastAPI runs sync endpoints in a pool)."""

    def __init__(self, max_runs: int = PLAN_CACHE_RUNS):
        self.max_runs = max_runs
        self._answers: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, run_id: str, version: str) -> Any | None:
        with self._lock:
            kept = self._answers.get(run_id)
            if kept is None or kept[0] != version:
                self.misses += 1
                return None
            self._answers.move_to_end(run_id)
            self.hits += 1
            return kept[1]

    def put(self, run_id: str, version: str, answer: Any) -> None:
        with self._lock:
            self._answers[run_id] = (version, answer)
            self._answers.move_to_end(run_id)
            while len(self._answers) > self.max_runs:
                self._answers.popitem(last=False)
