"""All-reduce benchmark (real gloo processes on CPU) and its fit to the ring model (pure numpy)."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tests.processes import gone, wait_for
from tests.test_no_torch import _run as run_with_torch_blocked
from tula_service.fit.perfmodel.comm_fit import RingAllReduceFit, fit_comm_record
from tula_service.measurement import parse_measurement

LATENCY_S = 20e-6
BANDWIDTH_GBPS = 100.0
WORLD_SIZES = np.array([2, 4, 8])
MESSAGE_BYTES = 1024.0 * 4.0 ** np.arange(11)  # 1 KiB .. 1 GiB


def exact_ring_times(world_size, message_bytes):
    n, size = np.asarray(world_size, dtype=float), np.asarray(message_bytes, dtype=float)
    return 2 * (n - 1) * LATENCY_S + 2 * (n - 1) / n * size / (BANDWIDTH_GBPS * 1e9 / 8)


def exact_grid():
    n, size = (grid.ravel() for grid in np.meshgrid(WORLD_SIZES, MESSAGE_BYTES))
    return n, size, exact_ring_times(n, size)


def test_fit_recovers_latency_and_bandwidth_from_exact_points():
    model = RingAllReduceFit().fit(*exact_grid())
    assert model.latency_s_ == pytest.approx(LATENCY_S, rel=1e-6)
    assert model.bandwidth_gbps_ == pytest.approx(BANDWIDTH_GBPS, rel=1e-6)
    assert np.max(np.abs(model.rel_errors_)) < 1e-9 and np.max(np.abs(model.loo_rel_errors_)) < 1e-9
    assert model.quality()["leave_one_out"]["points"] == WORLD_SIZES.size * MESSAGE_BYTES.size


def test_fitted_model_predicts_like_the_planners_ring_all_reduce():
    model = RingAllReduceFit().fit(*exact_grid())
    ring = model.to_ring_all_reduce(gradient_bytes=1e8)
    devices = np.array([1, 2, 8, 64])
    assert ring.predict(devices) == pytest.approx(model.predict(devices, 1e8))
    assert ring.predict(devices) == pytest.approx(np.where(devices > 1, exact_ring_times(devices, 1e8), 0.0))


@pytest.mark.parametrize(
    ("world_size", "message_bytes", "time_s", "message"),
    [
        ([2, 2], [1024, 4096], [1e-4, 2e-4], "at least 3"),
        ([2, 2, 2], [4096, 4096, 4096], [1e-4, 1e-4, 1e-4], "two message sizes"),
        ([1, 2, 2], [1024, 4096, 16384], [1e-4, 2e-4, 3e-4], "world_size must be >= 2"),
        ([2, 2, 2], [1024, 4096, 16384], [1e-4, -2e-4, 3e-4], "time_s must be positive"),
        ([2, 2, 2], [1024, 4096], [1e-4, 2e-4, 3e-4], "differ in length"),
    ],
)
def test_fit_rejects_points_it_cannot_use(world_size, message_bytes, time_s, message):
    with pytest.raises(ValueError, match=message):
        RingAllReduceFit().fit(world_size, message_bytes, time_s)


def test_times_that_fall_with_message_size_leave_the_bandwidth_unresolved():
    """A busy host can inflate the small messages' medians above the large ones': the fit is then latency
    alone, says so with an infinite bandwidth, and refuses to become the planner's network term."""
    model = RingAllReduceFit().fit([2, 2, 2, 2], [1024, 16384, 262144, 4194304], [1.4e-3, 1.2e-3, 1.1e-3, 1.0e-3])

    assert model.seconds_per_byte_ == 0 and model.bandwidth_gbps_ == np.inf and model.latency_s_ > 0
    with pytest.raises(ValueError, match="bandwidth is infinite"):
        model.to_ring_all_reduce(gradient_bytes=4e6)


def test_failed_record_is_not_fitted():
    record = {"kind": "comm", "status": "failed", "error": "RankFailure: rank 1 failed", "points": []}
    with pytest.raises(ValueError, match="rank 1 failed"):
        fit_comm_record(parse_measurement(record))


def test_comm_fit_imports_without_torch():
    result = run_with_torch_blocked(
        """
        import sys
        from tula_service.fit.perfmodel.comm_fit import RingAllReduceFit
        model = RingAllReduceFit().fit([2, 2, 4], [1024, 1e6, 1e6], [1e-4, 1e-3, 2e-3])
        assert model.bandwidth_gbps_ > 0
        assert not any(name == "torch" or name.startswith("torch.") for name in sys.modules)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


# The tests below start real processes; they import torch through profiler.comm.


def test_gloo_run_on_two_processes_measures_times_that_fit_the_ring():
    from profiler.comm import CommPolicy, measure_all_reduce

    quick = CommPolicy(warmup_iters=2, min_iters=5, max_iters=30, seconds_per_size=0.05)
    record = measure_all_reduce(4 * 2**20, world_sizes=[2], backend="gloo", policy=quick, timeout_s=60)

    assert record["status"] == "ok", record["error"]
    assert (record["kind"], record["backend"], record["device"], record["schema_version"]) == ("comm", "gloo", "cpu", 1)
    points = record["points"]
    assert [p["message_bytes"] for p in points] == [1024 * 4**k for k in range(7)]
    assert all(p["world_size"] == 2 and p["count"] >= 5 for p in points)
    assert all(0 < p["p10_s"] <= p["median_s"] <= p["p90_s"] for p in points)
    # 4 MiB against 256 KiB: a 16x step, and against 1 KiB; p10 because a shared 2-core host adds scheduling noise
    # above it (a busy host once gave the 1 KiB size a median 1.4x the 4 MiB one's)
    assert points[-1]["p10_s"] > points[-3]["p10_s"] and points[-1]["p10_s"] > points[0]["p10_s"]
    # the service fits the medians; on a busy host they can come out flat or falling (the fit then says
    # "bandwidth unresolved", tested above: the times that fall), so the ring is checked on the p10 times that grew
    assert np.isfinite(fit_comm_record(parse_measurement(record)).latency_s_)
    model = RingAllReduceFit().fit([2] * len(points), [p["message_bytes"] for p in points], [p["p10_s"] for p in points])
    assert 0 < model.bandwidth_gbps_ < np.inf and model.latency_s_ >= 0
    assert multiprocessing.active_children() == []


def test_gloo_record_says_it_runs_the_short_policy_and_does_not_inform_the_network_model():
    from profiler.comm import GLOO_POLICY, measure_all_reduce

    record = measure_all_reduce(16 * 1024, world_sizes=[2], backend="gloo", timeout_s=60)

    assert record["status"] == "ok", record["error"]
    assert record["policy"]["seconds_per_size"] == GLOO_POLICY.seconds_per_size
    assert record["informs_network_model"] is False and "not a GPU interconnect" in record["measured"]
    assert record["launcher"] == "forked_processes"
    assert [p["message_bytes"] for p in record["points"]] == [1024, 4096, 16384]


def _rank_number(rank, world_size, device):
    return rank


def test_forked_launches_of_four_ranks_do_not_hang():
    """Ranks forked while the store's thread held a lock hung, about one launch of four ranks in four
    on a busy host (profiler.comm.run_on_ranks). gloo's own rare "Connection closed by peer" while
    forming the group is a failed launch, not a hang: not what this test is about."""
    from profiler.comm import RankFailure, run_on_ranks

    hung = []
    for launch in range(20):
        try:
            assert run_on_ranks(_rank_number, 4, "gloo", timeout_s=10) == [0, 1, 2, 3]
        except RankFailure as error:
            if "timed out" in str(error):
                hung.append(launch)
    assert hung == []


_SET_IN_THIS_PROCESS = []  # a spawned rank re-imports this module and finds it empty


def _what_the_rank_inherited(rank, world_size, device):
    return {"marks": list(_SET_IN_THIS_PROCESS), "torch_imported": "torch" in sys.modules, "parent": os.getppid()}


def test_gloo_ranks_are_forked_from_the_launching_process():
    from profiler.comm import run_on_ranks

    _SET_IN_THIS_PROCESS.append("launcher state")
    try:
        results = run_on_ranks(_what_the_rank_inherited, 2, "gloo", timeout_s=60)
    finally:
        _SET_IN_THIS_PROCESS.clear()
    assert [r["marks"] for r in results] == [["launcher state"], ["launcher state"]]
    assert all(r["torch_imported"] and r["parent"] == os.getpid() for r in results)
    assert multiprocessing.active_children() == []


def _written_pids(folder: Path) -> list[int]:
    return [int(text) for path in sorted(folder.glob("rank*.pid")) if (text := path.read_text())]


LAUNCH_RANKS_THAT_HANG = """
import os, sys, time
from pathlib import Path
from profiler.comm import run_on_ranks

def hang(rank, world_size, device):
    Path(sys.argv[1], f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)

run_on_ranks(hang, 2, "gloo", timeout_s=600)
"""


def test_ranks_die_with_the_process_that_launched_them(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH_RANKS_THAT_HANG, str(tmp_path)], cwd=REPO)
    try:
        rank_pids = wait_for(lambda: len(pids := _written_pids(tmp_path)) == 2 and pids, 60, "both ranks to start")
    finally:
        launcher.kill()
        launcher.wait()
    try:
        wait_for(lambda: all(gone(pid) for pid in rank_pids), 10, "the ranks to die with their launcher")
    finally:
        for pid in rank_pids:  # nothing left behind, even when the test fails
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_impossible_world_size_is_failed_data():
    from profiler.comm import measure_all_reduce

    record = measure_all_reduce(4096, world_sizes=[2, 9], backend="gloo")
    assert record["status"] == "failed" and record["points"] == []
    assert "world sizes [9] are impossible" in record["error"]


def _rank_one_raises_rank_zero_hangs(rank, world_size, device, pid_dir):
    import torch.distributed as dist

    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both pids are on disk before anything fails
    if rank == 1:
        raise ValueError("rank 1 refuses to all-reduce")
    time.sleep(600)


def test_a_rank_that_raises_is_reported_and_its_peers_are_stopped(tmp_path):
    from profiler.comm import RankFailure, run_on_ranks

    started = time.monotonic()
    with pytest.raises(RankFailure, match="(?s)rank 1 failed.*rank 1 refuses to all-reduce"):
        run_on_ranks(_rank_one_raises_rank_zero_hangs, 2, "gloo", (str(tmp_path),), timeout_s=60)
    assert time.monotonic() - started < 30  # the hung rank was terminated, not waited for
    assert multiprocessing.active_children() == []
    pid_files = sorted(tmp_path.glob("rank*.pid"))
    assert len(pid_files) == 2
    for pid_file in pid_files:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_timeout_is_failed_data_and_leaves_no_process():
    from profiler.comm import measure_all_reduce

    record = measure_all_reduce(4096, world_sizes=[2], backend="gloo", timeout_s=0.01)
    assert record["status"] == "failed"
    assert "world size 2: timed out after 0.01 s" in record["error"]
    assert multiprocessing.active_children() == []


def test_cli_writes_a_failed_record_as_data(tmp_path):
    out = tmp_path / "comm.json"
    result = subprocess.run(
        [sys.executable, "-m", "profiler.comm", "--max-bytes", "4096", "--world-sizes", "2,9", "--backend", "gloo", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and "impossible" in result.stderr
    record = json.loads(out.read_text())
    assert (record["kind"], record["status"], record["world_sizes"]) == ("comm", "failed", [2, 9])
