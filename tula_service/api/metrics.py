"""Prometheus metrics at /metrics: jobs by state, queue depth, point durations, run plans' answers.

Jobs by state and queue depth are read from the database at scrape time (so every server process
on one database reports the same truth); point durations are a histogram of the attempts this
process recorded (`observe_point`); the answers to GET /v1/runs/{id}/plan a counter by how they were made
(`run_plan_answers`: computed, cached or not_modified, tula_service.runs.plan_cache). Each app has its own registry, so tests can run several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tula_service.store.db import Point
from tula_service.store.job_store import Store
from tula_service.store.states import JOB_STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
POINT_DURATION_BUCKETS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class _StoreCollector(Collector):
    def __init__(self, store: Store):
        self.store = store

    def collect(self):
        jobs = GaugeMetricFamily("tula_jobs", "Jobs in the database by state", labels=["state"])
        counts = self.store.jobs_by_state()
        for state in JOB_STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        yield GaugeMetricFamily(
            "tula_queue_depth_points", "Profiling points queued for a worker (active jobs)", value=self.store.queued_points()
        )
        yield GaugeMetricFamily(
            "tula_running_points", "Profiling points running on a worker", value=len(self.store.running_points())
        )


class Metrics:
    def __init__(self, store: Store):
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(store))
        self.point_duration_s = Histogram(
            "tula_point_duration_seconds",
            "Wall time of finished profiling points recorded by this process",
            ["kind", "state"],
            buckets=POINT_DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.run_plan_answers = Counter(
            "tula_run_plan_answers",
            "GET /v1/runs/{id}/plan answers of this process: computed (re-planned), cached (the same inputs' answer "
            "served again), not_modified (304: the client's ETag was current)",
            ["answer"],
            registry=self.registry,
        )

    def observe_point(self, point: Point) -> None:
        if point.duration_s is not None:
            self.point_duration_s.labels(point.kind, point.state).observe(point.duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
