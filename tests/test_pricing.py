"""What a plan costs per pricing kind (tula_service.plan.pricing), and the planner's cost from it."""

from typing import get_args

import numpy as np
import pytest

from tula_service.plan import pricing
from tula_service.plan.planner import PlanInputs, cost_usd
from tula_service.plan.pricing import PRICING_RULES, pricing_rule
from tula_service.spec.job_spec import PricingKind
from tula_service.units import GIB

DEVICES = np.array([1, 8, 9, 16])
NODES = np.array([1, 1, 2, 2])  # packed on nodes of 8


def test_the_specs_pricing_kinds_are_the_registrys():
    assert set(get_args(PricingKind)) == set(PRICING_RULES)
    assert all(rule.kind == kind for kind, rule in PRICING_RULES.items())


def test_every_rule_is_written_in_the_module_docstring():
    for rule in PRICING_RULES.values():
        assert rule.kind in pricing.__doc__ and rule.formula in pricing.__doc__


def test_gpu_hour_bills_every_device():
    assert pricing_rule("gpu_hour").billed_units(DEVICES, NODES, np.full(4, GIB)).tolist() == [1, 8, 9, 16]


def test_node_hour_bills_the_nodes_the_placement_uses():
    assert pricing_rule("node_hour").billed_units(DEVICES, NODES, np.full(4, GIB)).tolist() == [1, 1, 2, 2]
    spread = np.array([1, 4, 4, 4])  # the same devices dealt out over up to 4 nodes
    assert pricing_rule("node_hour").billed_units(DEVICES, spread, np.full(4, GIB)).tolist() == [1, 4, 4, 4]


def test_memory_gb_hour_bills_the_memory_used():
    memory_bytes = np.array([0.5, 2.0, 3.0, 1.0]) * GIB
    billed = pricing_rule("memory_gb_hour").billed_units(DEVICES, NODES, memory_bytes)
    assert billed.tolist() == [0.5, 16.0, 27.0, 16.0]


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match=r"^pricing kind 'spot' is unknown; known: gpu_hour, memory_gb_hour, node_hour$"):
        pricing_rule("spot")


def _inputs(kind: str) -> PlanInputs:
    return PlanInputs(np.array([8]), 16, 80 * GIB, 1000, kind, price=10.0, gpus_per_node=8, fixed_overhead_usd=3.0)


def test_cost_is_overhead_plus_hours_times_billed_units_times_price():
    hours = np.array([2.0, 2.0, 2.0, 2.0])
    memory_bytes = np.full(4, 4 * GIB)
    assert cost_usd(_inputs("node_hour"), hours, DEVICES, NODES, memory_bytes).tolist() == [23.0, 23.0, 43.0, 43.0]
    assert cost_usd(_inputs("memory_gb_hour"), hours, DEVICES, NODES, memory_bytes).tolist() == [83.0, 643.0, 723.0, 1283.0]


def test_cost_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="pricing kind 'spot' is unknown"):
        cost_usd(_inputs("spot"), np.ones(4), DEVICES, NODES, np.full(4, GIB))
