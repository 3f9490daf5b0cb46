"""The store on SQLite and on PostgreSQL: jobs, idempotency keys, claiming points, conditional state
changes, restarts, deletion, listing and a job's points a page at a time. Every test runs on a fresh database of each backend."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import delete, event, func, inspect, select

from tests.handmade import spec_dict
from tula_service.spec.job_spec import JobSpec
from tula_service.store.db import Job, Point, make_engine, make_session_factory
from tula_service.store.job_store import IdempotencyConflict, Store

BARRIER_TIMEOUT_S = 30


def job_spec(**overrides) -> JobSpec:
    return JobSpec.model_validate(spec_dict(**overrides))


@pytest.fixture
def engine(database_url):
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine) -> Store:
    return Store(make_session_factory(engine))


def point_rows(store: Store, job_id: str) -> int:
    with store.session() as session:
        return session.scalar(select(func.count()).select_from(Point).where(Point.job_id == job_id))


def in_threads(count: int, work) -> list:
    """Run work(index) in `count` threads at once; re-raises the first exception of any."""
    with ThreadPoolExecutor(count) as pool:
        return [future.result() for future in [pool.submit(work, index) for index in range(count)]]


# --- jobs ------------------------------------------------------------------------------------------


def test_create_job_stores_the_job_with_one_queued_point_per_batch_size(store):
    job, created = store.create_job(job_spec(name="three", batch_sizes=[8, 16, 32]))

    assert created is True
    stored = store.get_job(job.id)
    assert (stored.name, stored.state, stored.spec["batch_sizes"]) == ("three", "queued", [8, 16, 32])
    assert [(p.kind, p.batch_size, p.state, p.attempts) for p in stored.points] == [
        ("grid", 8, "queued", 0), ("grid", 16, "queued", 0), ("grid", 32, "queued", 0),
    ]  # fmt: skip


def test_a_multi_device_cluster_adds_a_communication_point(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16], cluster={"gpus_per_node": 4}))

    assert [(p.kind, p.batch_size) for p in store.get_job(job.id).points] == [("grid", 8), ("grid", 16), ("comm", None)]


def test_the_same_idempotency_key_and_spec_return_the_first_job(store):
    first, first_created = store.create_job(job_spec(), idempotency_key="retry-me")
    again, again_created = store.create_job(job_spec(), idempotency_key="retry-me")

    assert (first_created, again_created) == (True, False)
    assert again.id == first.id
    assert [p.id for p in again.points] == [p.id for p in first.points]
    assert store.count_jobs() == 1


def test_an_idempotency_key_reused_for_another_spec_is_refused(store):
    first, _ = store.create_job(job_spec(batch_sizes=[8, 16]), idempotency_key="once")

    with pytest.raises(IdempotencyConflict) as conflict:
        store.create_job(job_spec(batch_sizes=[8, 32]), idempotency_key="once")

    assert conflict.value.job_id == first.id
    assert store.count_jobs() == 1


def test_jobs_without_a_key_are_never_deduplicated(store):
    store.create_job(job_spec())
    store.create_job(job_spec())

    assert store.count_jobs() == 2


class LockstepStore(Store):
    """A store whose submitters all look the key up before any of them inserts: the race of two
    identical requests arriving at once, made certain instead of likely."""

    def __init__(self, sessions, submitters: int):
        super().__init__(sessions)
        self.barrier = threading.Barrier(submitters, timeout=BARRIER_TIMEOUT_S)
        self.looked_up = threading.local()

    def _job_by_key(self, key, digest):
        job = super()._job_by_key(key, digest)
        if not getattr(self.looked_up, "once", False):
            self.looked_up.once = True
            assert job is None, "the lock-step lookup happens before any insert"
            self.barrier.wait()
        return job


def test_concurrent_submissions_with_one_idempotency_key_make_exactly_one_job(engine):
    submitters = 6
    store = LockstepStore(make_session_factory(engine), submitters)

    results = in_threads(submitters, lambda _: store.create_job(job_spec(name="raced"), idempotency_key="raced-key"))

    assert sorted(created for _, created in results) == [False] * (submitters - 1) + [True]
    assert len({job.id for job, _ in results}) == 1
    assert store.count_jobs() == 1
    assert point_rows(store, results[0][0].id) == len(job_spec().batch_sizes)


def test_set_job_state_leaves_a_finished_job_alone(store):
    job, _ = store.create_job(job_spec())

    assert store.set_job_state(job.id, "done", recommendation={"knee": 1}) is True
    assert store.set_job_state(job.id, "failed", error="late") is False

    stored = store.get_job(job.id)
    assert (stored.state, stored.recommendation, stored.error) == ("done", {"knee": 1}, None)
    assert stored.finished_at is not None


# --- claiming points -------------------------------------------------------------------------------


def test_claim_next_point_takes_the_oldest_queued_point_and_starts_the_job(store):
    first, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    store.create_job(job_spec(batch_sizes=[32, 64]))

    point = store.claim_next_point("local:test:1")

    assert (point.id, point.state, point.attempts, point.worker) == (first.points[0].id, "running", 1, "local:test:1")
    assert point.started_at is not None
    assert store.get_job(first.id).state == "profiling"
    assert store.queued_points() == 3


def test_claim_next_point_is_none_when_nothing_is_queued(store):
    assert store.claim_next_point("idle") is None


def test_two_claimers_that_saw_the_same_point_never_both_get_it(engine, store):
    """Both claimers read the oldest queued point before either marks it running."""
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    both_read = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
    waited = threading.local()

    @event.listens_for(engine, "before_cursor_execute")
    def _after_the_read(_conn, _cursor, statement, *_args):
        if statement.lstrip().upper().startswith("UPDATE POINTS") and not getattr(waited, "once", False):
            waited.once = True
            both_read.wait()

    claims = in_threads(2, lambda index: store.claim_next_point(f"claimer-{index}"))

    winners = [point for point in claims if point is not None]
    assert len(winners) == 1
    stored = store.get_point(job.points[0].id)
    assert (stored.state, stored.attempts, stored.worker) == ("running", 1, winners[0].worker)


def test_concurrent_claimers_take_every_point_exactly_once(store):
    for batch_sizes in ([8, 16, 32, 64], [8, 16, 32], [8, 16, 32, 64, 128]):
        store.create_job(job_spec(batch_sizes=batch_sizes))
    claimers = 6
    start = threading.Barrier(claimers, timeout=BARRIER_TIMEOUT_S)

    def claim_until_empty(index: int) -> list[int]:
        start.wait()
        claimed = []
        for _ in range(1000):  # a claim can lose a race and find nothing; the queue empties long before
            point = store.claim_next_point(f"claimer-{index}")
            if point is not None:
                claimed.append(point.id)
            elif store.queued_points() == 0:
                return claimed
        raise AssertionError(f"queued points left that claim_next_point never returns: {store.queued_points()}")

    claimed = [point_id for ids in in_threads(claimers, claim_until_empty) for point_id in ids]

    with store.session() as session:
        all_points = list(session.scalars(select(Point)))
    assert sorted(claimed) == sorted(p.id for p in all_points)  # each one, once
    assert {(p.state, p.attempts) for p in all_points} == {("running", 1)}


# --- conditional state changes ---------------------------------------------------------------------


def test_finish_point_records_a_running_point_once(store):
    store.create_job(job_spec(batch_sizes=[8, 16]))
    point = store.claim_next_point("w")

    assert store.finish_point(point.id, "done", {"batch_size": 8}, None, 1.5) is True
    assert store.finish_point(point.id, "failed", None, "late duplicate", 9.0) is False

    stored = store.get_point(point.id)
    assert (stored.state, stored.measurement, stored.error, stored.duration_s) == ("done", {"batch_size": 8}, None, 1.5)
    assert stored.finished_at is not None


def test_finish_point_refuses_a_point_that_is_not_running(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16]))

    assert store.finish_point(job.points[0].id, "done", {"batch_size": 8}, None, 1.0) is False
    assert store.get_point(job.points[0].id).state == "queued"


def test_retry_point_requeues_a_running_point_and_keeps_why(store):
    store.create_job(job_spec(batch_sizes=[8, 16]))
    point = store.claim_next_point("w")
    store.set_point_worker(point.id, "local:host:1", 4242)

    assert store.retry_point(point.id, "attempt 1 on local:host:1: killed by signal 9") is True

    stored = store.get_point(point.id)
    assert (stored.state, stored.started_at, stored.worker_pid) == ("queued", None, None)
    assert stored.error == "attempt 1 on local:host:1: killed by signal 9"
    assert stored.attempt_errors == ["attempt 1 on local:host:1: killed by signal 9"]
    again = store.claim_next_point("w")
    assert (again.id, again.attempts) == (point.id, 2)
    assert store.retry_point(point.id, "second death") is True
    assert store.get_point(point.id).attempt_errors == ["attempt 1 on local:host:1: killed by signal 9", "second death"]


def test_retry_point_refuses_a_point_that_is_not_running(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16]))

    assert store.retry_point(job.points[0].id, "not running") is False
    assert store.retry_point(10**6, "unknown point") is False
    stored = store.get_point(job.points[0].id)
    assert (stored.state, stored.error, stored.attempt_errors) == ("queued", None, None)


def test_cancel_job_cancels_its_unfinished_points_and_returns_the_running_ones(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16, 32]))
    finished = store.claim_next_point("w")
    store.finish_point(finished.id, "done", {"batch_size": 8}, None, 1.0)
    running = store.claim_next_point("w")
    store.set_point_worker(running.id, "local:host:1", 4242)

    returned = store.cancel_job(job.id)

    assert [(p.id, p.worker, p.worker_pid) for p in returned] == [(running.id, "local:host:1", 4242)]
    stored = store.get_job(job.id)
    assert (stored.state, stored.finished_at is not None) == ("cancelled", True)
    assert [(p.state, p.error) for p in stored.points] == [
        ("done", None), ("cancelled", "job cancelled"), ("cancelled", "job cancelled"),
    ]  # fmt: skip
    assert store.queued_points() == 0
    assert store.claim_next_point("w") is None


def test_a_worker_finishing_after_its_job_was_cancelled_is_refused(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    point = store.claim_next_point("w")
    store.cancel_job(job.id)

    assert store.finish_point(point.id, "done", {"batch_size": 8}, None, 1.0) is False
    assert store.retry_point(point.id, "worker died") is False

    stored = store.get_point(point.id)
    assert (stored.state, stored.measurement, stored.error) == ("cancelled", None, "job cancelled")


def test_cancelling_a_finished_or_cancelled_job_changes_nothing(store):
    done, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    store.set_job_state(done.id, "done")
    cancelled, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    store.cancel_job(cancelled.id)

    assert store.cancel_job(done.id) == []
    assert store.cancel_job(cancelled.id) == []
    assert store.get_job(done.id).state == "done"
    assert store.get_job(done.id).points[0].state == "queued"


def test_cancelling_an_unknown_job_is_a_key_error(store):
    with pytest.raises(KeyError):
        store.cancel_job("no-such-job")


# --- restarts --------------------------------------------------------------------------------------


def test_requeue_interrupted_puts_running_points_back_with_a_reason(store):
    store.create_job(job_spec(batch_sizes=[8, 16, 32]))
    first = store.claim_next_point("local:old-host:1")
    second = store.claim_next_point(None)
    store.set_point_worker(first.id, "local:old-host:1", 4242)

    requeued = store.requeue_interrupted()

    assert sorted(p.id for p in requeued) == [first.id, second.id]
    for point, worker in ((first, "local:old-host:1"), (second, "a worker")):
        stored = store.get_point(point.id)
        assert (stored.state, stored.started_at, stored.worker_pid, stored.attempts) == ("queued", None, None, 1)
        assert stored.attempt_errors == [f"attempt 1 on {worker}: interrupted (server stopped)"]
    assert store.requeue_interrupted() == []
    assert store.queued_points() == 3


def test_requeue_interrupted_returns_the_points_as_they_were_so_orphans_can_be_reaped(store):
    """The executor kills the dead server's profiling children by the returned worker and pid."""
    store.create_job(job_spec(batch_sizes=[8, 16]))
    point = store.claim_next_point("local:old-host:1")
    store.set_point_worker(point.id, "local:old-host:1", 4242)

    [returned] = store.requeue_interrupted()

    assert (returned.id, returned.state, returned.worker, returned.worker_pid) == (point.id, "running", "local:old-host:1", 4242)


# --- deletion --------------------------------------------------------------------------------------


def test_delete_job_removes_the_job_and_its_points_only(store):
    doomed, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    kept, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    store.claim_next_point("w")

    assert store.delete_job(doomed.id) is True

    assert store.get_job(doomed.id) is None
    assert point_rows(store, doomed.id) == 0
    assert point_rows(store, kept.id) == 2
    assert store.delete_job(doomed.id) is False


def test_the_database_cascades_a_deleted_job_to_its_points(store):
    """The foreign key itself (ON DELETE CASCADE, with SQLite's foreign_keys pragma on)."""
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16]))

    with store.session() as session, session.begin():
        session.execute(delete(Job).where(Job.id == job.id))

    assert point_rows(store, job.id) == 0


# --- listing ---------------------------------------------------------------------------------------


@pytest.fixture
def five_jobs(store) -> dict[str, str]:
    """Five jobs, id -> state: two queued, two done, one cancelled."""
    states = ["queued", "done", "cancelled", "done", "queued"]
    jobs = {}
    for index, state in enumerate(states):
        job, _ = store.create_job(job_spec(name=f"job-{index}", batch_sizes=[8, 16]))
        if state == "cancelled":
            store.cancel_job(job.id)
        elif state != "queued":
            store.set_job_state(job.id, state)
        jobs[job.id] = state
    return jobs


def test_count_jobs_and_jobs_by_state_count_every_state(store, five_jobs):
    assert store.count_jobs() == 5
    assert store.count_jobs(["queued"]) == 2
    assert store.count_jobs(["done", "cancelled"]) == 3
    assert store.count_jobs(["failed"]) == 0
    assert store.jobs_by_state() == {"queued": 2, "done": 2, "cancelled": 1}


def test_list_jobs_is_newest_first_and_filters_by_state(store, five_jobs):
    listed = store.list_jobs()

    assert {job.id for job in listed} == set(five_jobs)
    assert [job.id for job in listed] == [job.id for job in sorted(listed, key=lambda j: (-j.created_at.timestamp(), j.id))]
    assert all(len(job.points) == 2 for job in listed)  # loaded with the job
    done = store.list_jobs(["done"])
    assert sorted(job.id for job in done) == sorted(job_id for job_id, state in five_jobs.items() if state == "done")


def test_list_jobs_pages_through_every_job_once(store, five_jobs):
    pages = [store.list_jobs(limit=2, offset=offset) for offset in (0, 2, 4, 6)]

    assert [len(page) for page in pages] == [2, 2, 1, 0]
    assert [job.id for page in pages for job in page] == [job.id for job in store.list_jobs()]
    queued_pages = [store.list_jobs(["queued"], limit=1, offset=offset) for offset in (0, 1, 2)]
    assert sorted(job.id for page in queued_pages for job in page) == sorted(
        job_id for job_id, state in five_jobs.items() if state == "queued"
    )


def test_job_points_pages_one_jobs_points_in_order_without_their_measurements(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16, 32]))
    store.create_job(job_spec(batch_sizes=[64, 128]))  # another job's points are not in the pages
    point = store.claim_next_point("w")
    store.finish_point(point.id, "done", {"batch_size": 8}, None, 1.5)

    pages = [store.job_points(job.id, limit=2, offset=offset) for offset in (0, 2, 4)]

    assert [total for total, _ in pages] == [3, 3, 3]
    assert [[p.batch_size for p in points] for _, points in pages] == [[8, 16], [32], []]
    first = pages[0][1][0]
    assert (first.state, first.duration_s) == ("done", 1.5) and "measurement" in inspect(first).unloaded


def test_job_points_of_an_unknown_job_are_none(store):
    assert store.job_points("nope") is None


def test_get_job_without_measurements_has_every_point_but_not_their_records(store):
    job, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    point = store.claim_next_point("w")
    store.finish_point(point.id, "done", {"batch_size": 8}, None, 1.5)

    light = store.get_job(job.id, measurements=False)

    assert [(p.batch_size, p.state) for p in light.points] == [(8, "done"), (16, "queued")]
    assert all("measurement" in inspect(p).unloaded for p in light.points)
    assert store.get_job(job.id).points[0].measurement == {"batch_size": 8}


def test_queued_points_counts_only_queued_points_of_active_jobs(store):
    active, _ = store.create_job(job_spec(batch_sizes=[8, 16, 32]))
    cancelled, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    assert store.queued_points() == 5

    store.cancel_job(cancelled.id)
    store.claim_next_point("w")
    assert store.queued_points() == 2

    failed, _ = store.create_job(job_spec(batch_sizes=[8, 16]))
    store.set_job_state(failed.id, "failed", error="gave up")
    assert store.queued_points() == 2  # its points are still 'queued' but its job is over
