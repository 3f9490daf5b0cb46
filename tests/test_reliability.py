"""Noisy profiles are timed again once, and a profile that stays noisy says so (tula_service.dispatch.reliability)."""

from tests.handmade import measurement, spec_dict
from tula_service.dispatch.dispatcher import Outcome, record_outcome
from tula_service.dispatch.reliability import UNRELIABLE, assess, points_to_retime
from tula_service.plan.recommend import plan, usable_measurements
from tula_service.spec.job_spec import JobSpec
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.job_store import Store


def _noisy(batch: int, cv: float, slowdown: float = 1.0) -> dict:
    record = measurement(batch)
    record["iter_time"] = {**record["iter_time"], "cv": cv, "median_s": record["iter_time"]["median_s"] * slowdown}
    record["host_load"] = {"contended": cv > 0.25}
    return record


def test_a_point_with_a_high_cv_is_timed_again_once():
    ok = [measurement(8), _noisy(16, cv=0.9), measurement(32), measurement(64)]
    assert points_to_retime(ok, retimed_batches=[]) == [16]
    assert points_to_retime(ok, retimed_batches=[16]) == []


def test_a_point_whose_few_slow_iterations_leave_its_median_alone_is_not_timed_again():
    """std / mean 90% from a few 10x-slow iterations, robust CV 5%: the median the model fits is sound."""
    outliers = measurement(16)
    outliers["iter_time"] = {**outliers["iter_time"], "cv": 0.9, "robust_cv": 0.05}
    ok = [measurement(8), outliers, measurement(32), measurement(64)]
    assert points_to_retime(ok, retimed_batches=[]) == []
    scattered = measurement(16)
    scattered["iter_time"] = {**scattered["iter_time"], "cv": 0.3, "robust_cv": 0.4}
    assert points_to_retime([measurement(8), scattered, measurement(32), measurement(64)], retimed_batches=[]) == [16]


def test_a_point_off_the_step_time_line_is_timed_again():
    ok = [measurement(8), measurement(16), _noisy(32, cv=0.01, slowdown=3.0), measurement(64), measurement(128)]
    assert 32 in points_to_retime(ok, retimed_batches=[])


def test_a_clean_profile_needs_no_second_timing_and_is_reliable():
    ok = [measurement(b) for b in (8, 16, 32, 64)]
    assert points_to_retime(ok, []) == []
    verdict = assess(ok, {"median_rel_err": 0.01, "max_rel_err": 0.02, "points": 4}, [])
    assert verdict["verdict"] == "reliable" and verdict["reasons"] == []


def test_the_quieter_of_two_measurements_of_a_batch_is_used():
    first, second = _noisy(16, cv=0.6), _noisy(16, cv=0.05)
    ok, _ = usable_measurements([measurement(8), first, second])
    assert ok[1] is second
    ok, _ = usable_measurements([measurement(8), second, first])
    assert ok[1] is second


def test_a_profile_that_stays_noisy_is_marked_unreliable_with_its_reasons():
    ok = [_noisy(b, cv=0.8, slowdown=s) for b, s in ((8, 1.0), (16, 2.5), (32, 0.7), (64, 1.9), (128, 1.0))]
    verdict = assess(ok, {"median_rel_err": 0.75, "max_rel_err": 16.0, "points": 5}, [16, 32])
    assert verdict["verdict"] == "unreliable" and verdict["message"] == UNRELIABLE
    assert "mispredicts held-out points by 75%" in verdict["reasons"][0]
    assert "5 of 5 points have iteration-time CVs above 25%" in verdict["reasons"][1]
    assert "5 of 5 points ran on a contended host" in verdict["reasons"][2]
    assert verdict["retimed_batches"] == [16, 32]


def test_three_points_are_too_few_to_judge_one_by_the_others():
    ok = [measurement(8), measurement(16), _noisy(32, cv=0.01, slowdown=3.0)]
    assert points_to_retime(ok, retimed_batches=[]) == []
    assert assess(ok, {"median_rel_err": 0.9, "max_rel_err": 2.0, "points": 3}, [])["verdict"] == "reliable"


def test_the_recommendation_carries_the_verdict():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64]))
    rec = plan(spec, [_noisy(b, cv=0.8, slowdown=s) for b, s in ((8, 1.0), (16, 2.5), (32, 0.7), (64, 1.9))])
    assert rec["reliability"]["verdict"] == "unreliable"
    assert plan(spec, [measurement(b) for b in (8, 16, 32, 64)])["reliability"]["verdict"] == "reliable"


def test_a_job_with_a_noisy_point_times_it_again_then_finishes(tmp_path):
    store = Store(make_session_factory(make_engine(f"sqlite:///{tmp_path / 'tula.db'}")))
    job, _ = store.create_job(JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64])))
    while (point := store.claim_next_point("test")) is not None:
        noisy = point.kind == "grid" and point.batch_size == 16
        record = _noisy(16, cv=0.9) if noisy else measurement(point.batch_size)
        record_outcome(store, point.id, Outcome("done", record, None, False, 0.01, "test"))
    done = store.get_job(job.id)
    assert done.state == "done", done.error
    assert [(p.kind, p.batch_size) for p in done.points if p.kind == "retime"] == [("retime", 16)]
    reliability = done.recommendation["reliability"]
    assert reliability["verdict"] == "reliable" and reliability["retimed_batches"] == [16]
