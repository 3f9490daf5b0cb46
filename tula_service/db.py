"""Storage: SQLAlchemy 2.0 typed models and the engine (SQLite file by default)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, ForeignKey, Integer, String, Text, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), index=True)  # queued|profiling|fitting|done|failed
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    recommendation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[dt.datetime | None]

    points: Mapped[list[Point]] = relationship(
        back_populates="job", order_by="Point.id", cascade="all, delete-orphan"
    )


class Point(Base):
    """One profiling task of a job.

    kind "grid": the model at one of the spec's batch sizes; "search": a probe of the bounded search
    for the largest batch that fits (after an out-of-memory); "comm": the all-reduce benchmark.
    """

    __tablename__ = "points"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(8), default="grid")
    batch_size: Mapped[int | None]
    state: Mapped[str] = mapped_column(String(16), index=True)  # queued|running|done|oom|failed
    attempts: Mapped[int] = mapped_column(default=0)
    measurement: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    duration_s: Mapped[float | None]

    job: Mapped[Job] = relationship(back_populates="points")


def make_engine(database_url: str) -> Engine:
    if database_url.startswith("sqlite"):
        engine = create_engine(database_url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # WAL: readers never wait for the executor's writes
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    else:
        engine = create_engine(database_url, pool_pre_ping=True)
    Base.metadata.create_all(engine)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
