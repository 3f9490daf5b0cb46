"""Out-of-memory is data: real child processes under a real address-space limit, then the bounded
search for the largest batch that fits, through the real executor and store."""

import pytest

from tests.handmade import spec_dict
from tests.processes import run_until_finished
from tula_service.dispatch.executor import LocalExecutor
from tula_service.spec.job_spec import JobSpec

pytest.importorskip("torch")


@pytest.mark.e2e
def test_search_brackets_the_largest_batch_that_fits_under_a_memory_limit(store):
    spec = spec_dict(
        batch_sizes=[16, 64, 256, 4096, 8192],
        profiling={
            "memory_limit_gib": 0.25, "max_search_probes": 8, "grad_iters": 0,
            "time_cap_s": 0.1, "timed_iters": 2, "warmup_iters": 1,
        },
    )  # fmt: skip
    job, _ = store.create_job(JobSpec.model_validate(spec))
    finished = run_until_finished(store, LocalExecutor(store, poll_s=0.05), job.id, timeout_s=600)
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
