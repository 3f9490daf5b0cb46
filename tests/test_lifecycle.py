"""Lifecycle log lines: one key=value line per event on the `tula.lifecycle` logger."""

import logging

from tests.handmade import measurement
from tests.processes import submit
from tula_service.dispatch.dispatcher import Outcome, record_outcome
from tula_service.lifecycle import format_line


def _lines(caplog, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tula.lifecycle" and r.getMessage().startswith(f"event={event} ")]


def test_a_line_is_key_value_pairs_and_quotes_what_would_break_it():
    line = format_line("point_failed", job="ab12", point=3, duration_s=1.23456, error='died: "x" = y\nnext', worker=None)
    assert line == 'event=point_failed job=ab12 point=3 duration_s=1.235 error="died: \\"x\\" = y\\nnext"'
    assert "\n" not in line


def test_submitting_a_job_logs_it_with_its_points(store, caplog):
    caplog.set_level(logging.INFO, logger="tula.lifecycle")
    job = submit(store, batch_sizes=[8, 16, 32])
    [line] = _lines(caplog, "job_submitted")
    assert line == f"event=job_submitted job={job.id} name=handmade points=3"


def test_each_outcome_of_a_point_is_one_line_and_the_end_of_the_job_another(store, caplog):
    """A died attempt is retried, a record finishes the point, a point that fails its last attempt is
    failed; once every point is finished the job is fitted and its end logged."""
    caplog.set_level(logging.INFO, logger="tula.lifecycle")
    job = submit(store, batch_sizes=[8, 16, 32], profiling={"max_attempts": 2, "search_max_batch": False})
    died = Outcome("failed", None, "profiling process died (killed by signal 9)", True, 0.5, "local:test:1")
    for batch in (8, 16):
        point = store.claim_next_point("local:test:1")
        assert record_outcome(store, point.id, Outcome("done", measurement(batch), None, False, 2.0, "local:test:1")) == "finished"
    point = store.claim_next_point("local:test:1")
    assert record_outcome(store, point.id, died) == "retried"
    point = store.claim_next_point("local:test:1")
    assert record_outcome(store, point.id, died) == "finished"

    done = _lines(caplog, "point_done")
    assert len(done) == 2 and all("state=done duration_s=2 " in f"{line} " for line in done)
    [retried] = _lines(caplog, "point_retried")
    assert f"job={job.id} point={point.id} kind=grid batch=32 attempt=1 duration_s=0.5" in retried
    [failed] = _lines(caplog, "point_failed")
    assert "attempt=2" in failed and "failed after 2 attempts" in failed
    [finished] = _lines(caplog, "job_finished")
    assert finished.startswith(f"event=job_finished job={job.id} state=") and "points=3" in finished
    assert f"state={store.get_job(job.id).state} " in finished
