"""Storage: SQLAlchemy 2.0 typed models and the engine (SQLite file by default, PostgreSQL by URL).

The schema is owned by Alembic (`tula_service/store/migrations/`); `make_engine` brings any database to
the newest revision at start-up, so a server never runs against a schema it does not know.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, Text, UniqueConstraint, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker

if TYPE_CHECKING:
    from tula_service.spec.job_spec import JobSpec


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), index=True)  # one of JOB_STATES
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    recommendation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[dt.datetime | None]
    # Idempotency-Key of the submission (unique) and the SHA-256 of its canonical spec JSON, so a
    # retried POST returns this job and a reused key with another spec is refused.
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    spec_sha256: Mapped[str | None] = mapped_column(String(64))

    points: Mapped[list[Point]] = relationship(
        back_populates="job", order_by="Point.id", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def parsed_spec(self) -> JobSpec:
        """The stored spec, parsed once per loaded job (JobSpec.stored: the submission's allowlist and
        data-root decisions hold)."""
        parsed = self.__dict__.get("_parsed_spec")
        if parsed is None:
            from tula_service.spec.job_spec import JobSpec  # the spec's validators are a layer above storage

            parsed = self.__dict__["_parsed_spec"] = JobSpec.stored(self.spec)
        return parsed


class Point(Base):
    """One profiling task of a job.

    kind "grid": the model at one of the spec's batch sizes; "search": a probe of the bounded search
    for the largest batch that fits (after an out-of-memory); "retime": a noisy point timed once more
    (tula_service.dispatch.reliability); "comm": the all-reduce benchmark; "pilot":
    training at the reference batch with gradient statistics along the way (profiler.pilot); "step": a
    data-parallel training step on `placement` (GPUs used on each node), at per-device batch `batch_size`
    (profiler.ddp_step on one node, profiler.ray_group across nodes); "given": a measurement supplied with the job (POST /v1/jobs/from-measurements),
    stored done as it came, never run.
    `attempts` counts starts; `attempt_errors` keeps why each earlier attempt died (retried).
    """

    __tablename__ = "points"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(8), default="grid")
    batch_size: Mapped[int | None]
    state: Mapped[str] = mapped_column(String(16), index=True)  # one of POINT_STATES
    attempts: Mapped[int] = mapped_column(default=0)
    measurement: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    duration_s: Mapped[float | None] = mapped_column(Float)  # as revision 0001 made it
    worker: Mapped[str | None] = mapped_column(String(255))  # "local:HOST:PID" or "ray:NODE_ID"
    worker_pid: Mapped[int | None]  # the child process of a local run, so a restart can reap it
    attempt_errors: Mapped[list[str] | None] = mapped_column(JSON)
    placement: Mapped[list[int] | None] = mapped_column(JSON)  # a step point's GPUs on each node (revision 0003)

    job: Mapped[Job] = relationship(back_populates="points")


class Run(Base):
    """A training run that follows a job's recommendation and reports telemetry (tula_service.runs): the
    configuration it is advised to train with now (`config`), and every change of it with why (`decisions`)."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    options: Mapped[dict[str, Any]] = mapped_column(JSON)  # hysteresis, min_steps_between_changes
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    decisions: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    records: Mapped[int] = mapped_column(default=0)  # telemetry records stored
    last_step: Mapped[int | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_sha256: Mapped[str | None] = mapped_column(String(64))


class RunTelemetry(Base):
    """One telemetry record of a run, at most one per optimizer step (a re-sent step is not stored twice)."""

    __tablename__ = "run_telemetry"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_run_telemetry_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int]
    record: Mapped[dict[str, Any]] = mapped_column(JSON)


class ApiToken(Base):
    """An API token: only its SHA-256 is stored; `prefix` (the first characters) identifies it."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100))
    prefix: Mapped[str] = mapped_column(String(16))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]


def make_engine(database_url: str, *, migrate: bool = True) -> Engine:
    """An engine for `database_url`, with the schema migrated to the newest revision."""
    if database_url.startswith("sqlite"):
        engine = create_engine(database_url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # WAL: readers never wait for the executor's writes
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "checkout")
        def _sqlite_foreign_keys_on(dbapi_connection, _record, _proxy):  # a migration may have turned them off
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    else:
        engine = create_engine(normalized_url(database_url), pool_pre_ping=True, pool_size=10, max_overflow=20)
    if migrate:
        from tula_service.store.migrate import upgrade_to_head

        upgrade_to_head(engine)
    return engine


def normalized_url(database_url: str) -> str:
    """`postgresql://` and `postgres://` URLs use the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url.removeprefix(prefix)
    return database_url


def make_session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
