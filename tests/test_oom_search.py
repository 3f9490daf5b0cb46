"""Out-of-memory is data: real child processes under a real address-space limit, then the bounded
search for the largest batch that fits, through the real executor and store."""

import time

import pytest

from tula_service.db import make_engine, make_session_factory
from tula_service.executor import LocalExecutor
from tula_service.spec import JobSpec
from tula_service.store import Store
from tests.handmade import spec_dict

pytest.importorskip("torch")


@pytest.mark.e2e
def test_search_brackets_the_largest_batch_that_fits_under_a_memory_limit(tmp_path):
    store = Store(make_session_factory(make_engine(f"sqlite:///{tmp_path}/jobs.db")))
    spec = spec_dict(
        batch_sizes=[16, 64, 256, 4096, 8192],
        profiling={
            "memory_limit_gib": 0.25, "max_search_probes": 8, "grad_iters": 0,
            "time_cap_s": 0.1, "timed_iters": 2, "warmup_iters": 1,
        },
    )  # fmt: skip
    job, _ = store.create_job(JobSpec.model_validate(spec))
    executor = LocalExecutor(store, poll_s=0.05)
    executor.start()
    try:
        deadline = time.monotonic() + 600
        while store.get_job(job.id).state not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        executor.stop()
    finished = store.get_job(job.id)
    assert finished.state == "done", finished.error
    by_kind = {kind: [p for p in finished.points if p.kind == kind] for kind in ("grid", "search")}
    assert {p.batch_size: p.state for p in by_kind["grid"]}[4096] == "oom"
    skipped = [p for p in by_kind["grid"] if p.batch_size == 8192][0]
    assert skipped.state == "oom" and "already ran out of memory" in skipped.error  # not run at all
    assert 1 <= len(by_kind["search"]) <= 8
    limit = finished.recommendation["profiled"]["memory_limit"]
    assert 64 <= limit["largest_ok_batch"] < limit["smallest_oom_batch"] <= 4096
    tight = limit["smallest_oom_batch"] - limit["largest_ok_batch"] <= max(1, int(0.05 * limit["largest_ok_batch"]))
    assert tight or len(by_kind["search"]) == 8
    assert max(r["device_batch"] for r in finished.recommendation["candidates"]) <= limit["largest_ok_batch"]
