"""The version of a run's plan names every input of tula_service.runs.replan.advise, so an answer is served
again (or answered 304) only while none of them has changed; the cache keeps the latest runs."""

import datetime as dt
from types import SimpleNamespace

import pytest

from tula_service.runs import plan_cache
from tula_service.runs.plan_cache import PlanCache, matches, plan_version


def _run(**changes):
    run = {"id": "r1", "records": 40, "last_step": 40, "config": {"global_batch": 64, "lr": 0.1}, "options": {"hysteresis": 0.05},
           "decisions": []}  # fmt: skip
    return SimpleNamespace(**{**run, **changes})


def _job(**changes):
    job = {"id": "j1", "state": "done", "updated_at": dt.datetime(2026, 12, 5, 12, 0),
           "points": [SimpleNamespace(id="p1", state="done", attempts=1), SimpleNamespace(id="p2", state="oom", attempts=1)]}  # fmt: skip
    return SimpleNamespace(**{**job, **changes})


@pytest.mark.parametrize(
    "run_changes, job_changes",
    [
        ({"records": 41}, {}),
        ({"last_step": 41}, {}),
        ({"config": {"global_batch": 128, "lr": 0.1}}, {}),
        ({"options": {"hysteresis": 0.1}}, {}),
        ({"decisions": [{"step": 40}]}, {}),
        ({}, {"state": "running"}),
        ({}, {"updated_at": dt.datetime(2026, 12, 5, 12, 1)}),
        ({}, {"points": [SimpleNamespace(id="p1", state="done", attempts=2), SimpleNamespace(id="p2", state="oom", attempts=1)]}),
    ],
)
def test_the_version_changes_with_every_input_of_the_advice(run_changes, job_changes):
    assert plan_version(_run(), _job()) == plan_version(_run(), _job())
    assert plan_version(_run(**run_changes), _job(**job_changes)) != plan_version(_run(), _job())


def test_another_server_process_never_matches_a_version(monkeypatch):
    before = plan_version(_run(), _job())
    monkeypatch.setattr(plan_cache, "BOOT_ID", "another process")
    assert plan_version(_run(), _job()) != before


def test_if_none_match_takes_lists_weak_tags_and_the_wildcard():
    etag = plan_version(_run(), _job())
    assert matches(etag, etag) and matches(f'"x", W/{etag}', etag) and matches("*", etag)
    assert not matches(None, etag) and not matches("", etag) and not matches('"x"', etag) and not matches(etag.strip('"'), etag)


def test_the_cache_serves_only_the_version_it_holds_and_keeps_the_latest_runs():
    cache = PlanCache(max_runs=2)
    cache.put("a", "v1", "answer a")
    cache.put("b", "v1", "answer b")
    assert cache.get("a", "v1") == "answer a" and cache.get("a", "v2") is None
    cache.put("c", "v1", "answer c")  # "b" was used least recently
    assert cache.get("b", "v1") is None and cache.get("a", "v1") == "answer a" and cache.get("c", "v1") == "answer c"
    cache.put("a", "v2", "answer a, new")
    assert cache.get("a", "v1") is None and cache.get("a", "v2") == "answer a, new"
    assert (cache.hits, cache.misses) == (4, 3)
