"""Objectives beyond the knee, pricing kinds, and the property tests of the planner."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.handmade import measurement, spec_dict
from tula_service.plan.planner import Choice, choose, pareto_mask
from tula_service.plan.recommend import plan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128, 256, 512, 1024]
CLUSTER = {"nodes": 2, "gpus_per_node": 8, "interconnect_gbps": 10}
PARAMS = {"gradient_bytes": 400_000_000, "trace_sigma": 1e5}


def _plan(**spec_overrides):
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, cluster=CLUSTER, **spec_overrides))
    return plan(spec, [measurement(b, **PARAMS) for b in BATCHES])


def _time_h(row):
    return row["total_time_s"]["value"] / 3600


def test_deadline_picks_the_cheapest_plan_that_meets_it():
    fastest, cheapest = _plan(objective="min_time")["chosen"], _plan(objective="min_cost")["chosen"]
    deadline_h = (_time_h(fastest) + _time_h(cheapest)) / 2
    rec = _plan(objective="deadline", deadline_h=deadline_h)
    assert _time_h(rec["chosen"]) <= deadline_h and rec["constraint"]["met"]
    in_time = [r for r in rec["candidates"] if _time_h(r) <= deadline_h]
    assert rec["chosen"]["cost_usd"]["value"] == min(r["cost_usd"]["value"] for r in in_time)


def test_impossible_deadline_is_an_answer_naming_the_fastest():
    fastest = _plan(objective="min_time")["chosen"]
    rec = _plan(objective="deadline", deadline_h=_time_h(fastest) / 10)
    assert rec["constraint"]["met"] is False
    assert "no configuration finishes within" in rec["constraint"]["message"]
    assert rec["chosen"]["total_time_s"] == fastest["total_time_s"]


def test_budget_picks_the_fastest_plan_within_it():
    cheapest = _plan(objective="min_cost")["chosen"]
    budget = cheapest["cost_usd"]["value"] * 1.5
    rec = _plan(objective="budget", budget_usd=budget)
    assert rec["chosen"]["cost_usd"]["value"] <= budget and rec["constraint"]["met"]
    affordable = [r for r in rec["candidates"] if r["cost_usd"]["value"] <= budget]
    assert _time_h(rec["chosen"]) == min(_time_h(r) for r in affordable)


def test_impossible_budget_names_the_cheapest():
    rec = _plan(objective="budget", budget_usd=1e-9)
    assert rec["constraint"]["met"] is False and "costs at most" in rec["constraint"]["message"]


def test_deadline_objective_needs_its_limit():
    with pytest.raises(ValueError, match="needs deadline_h"):
        JobSpec.model_validate(spec_dict(objective="deadline"))


def test_node_hour_pricing_bills_the_nodes_of_the_placement():
    rec = _plan(pricing={"kind": "node_hour", "price": 10.0})
    kinds = {row["placement_kind"] for row in rec["candidates"]}
    assert kinds == {"packed", "spread"}  # both are swept on a cluster of several nodes
    for row in rec["candidates"]:
        nodes = len(row["placement"])
        if row["placement_kind"] == "packed":
            assert nodes == -(-row["devices"] // 8)
        assert row["cost_usd"]["value"] == pytest.approx(_time_h(row) * nodes * 10.0)


def test_fixed_overhead_is_added_to_every_candidate():
    base = _plan()["candidates"]
    with_overhead = _plan(pricing={"kind": "gpu_hour", "price": 2.0, "fixed_overhead_usd": 7.5})["candidates"]
    for a, b in zip(base, with_overhead):
        assert b["cost_usd"]["value"] == pytest.approx(a["cost_usd"]["value"] + 7.5)


def test_knee_lies_on_the_front_between_min_time_and_min_cost():
    rec = _plan()
    assert rec["chosen"]["pareto"]
    assert _time_h(_plan(objective="min_time")["chosen"]) <= _time_h(rec["chosen"]) <= _time_h(_plan(objective="min_cost")["chosen"])


def test_accumulation_plans_a_batch_beyond_device_memory():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32], cluster={"device_memory_gib": 1.0}))
    rec = plan(spec, [measurement(b, static_bytes=2e8, act_bytes_per_sample=2.5e7) for b in (8, 16, 32)])
    max_batch = rec["search_space"]["max_device_batch"]["value"]
    assert max_batch < 64
    beyond = [r for r in rec["candidates"] if r["global_batch"] > max_batch and r["devices"] == 1]
    assert beyond and all(r["accumulation"] > 1 and r["device_batch"] <= max_batch for r in beyond)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.1, 1e4), st.floats(0.1, 1e4)), min_size=3, max_size=80),
    st.lists(st.sampled_from([8, 16, 32, 64, 128, 256]), min_size=80, max_size=80),
)
def test_knee_is_on_the_front_and_between_the_extremes(points, batches):
    time_s, cost = (np.array(v) for v in zip(*points))
    candidates = {"total_time_s": time_s, "cost_usd": cost, "global_batch": np.array(batches[: time_s.size])}
    knee: Choice = choose(candidates, "knee")
    assert knee.front[knee.index]
    fastest, cheapest = choose(candidates, "min_time").index, choose(candidates, "min_cost").index
    assert time_s[fastest] <= time_s[knee.index] <= time_s[cheapest]
    assert cost[cheapest] <= cost[knee.index] <= cost[fastest]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 1e4), st.floats(0.1, 1e4)), min_size=1, max_size=80), st.floats(0.1, 1e4))
def test_a_met_deadline_is_really_met(points, deadline_s):
    time_s, cost = (np.array(v) for v in zip(*points))
    candidates = {"total_time_s": time_s, "cost_usd": cost, "global_batch": np.full(time_s.size, 8)}
    choice = choose(candidates, "deadline", deadline_h=deadline_s / 3600)
    assert choice.constraint["met"] == bool((time_s <= deadline_s).any())
    if choice.constraint["met"]:
        assert time_s[choice.index] <= deadline_s
    assert pareto_mask(time_s, cost).sum() >= 1
