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


@pytest.mark.parametrize(("device", "index"), [("cuda", 3), ("cuda:1", 1)])
def test_a_memory_limit_on_a_bare_cuda_device_names_the_current_device(monkeypatch, device, index):
    """On the H200 (benchmarks/gpu_check.py, 2026-12-04) a memory limit on torch.device("cuda") failed the point with
    torch's "Expected a torch.device with a specified index": set_per_process_memory_fraction refuses a device
    without an index. torch's own index check stands in for the GPU this machine lacks."""
    import torch
    from torch.cuda._utils import _get_device_index

    from profiler.memory import apply_memory_limit
    from tula_service.units import GIB

    fractions = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("Properties", (), {"total_memory": 8 * GIB})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: fractions.append((f, _get_device_index(d))))
    limit = apply_memory_limit(2 * GIB, torch.device(device))
    assert fractions == [(0.25, index)]
    assert limit == {"bytes": 2 * GIB, "how": "torch.cuda.set_per_process_memory_fraction"}
