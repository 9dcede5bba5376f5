"""Synchronous 2D groups priced (`sharding.two_d`): the replica sync and the all-reduce."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharding.cost_model import allreduce_s
from sharding.plan_eval import plan_cost
from sharding.planners import PLANNERS
from sharding.two_d import replica_sync_bytes, two_d_cost
from sharding.types import ClusterSpec, DeviceGroup, NetworkSpec, NodeGroup, TableStats
from tests.unit.test_planners import inputs_for

NODE = ClusterSpec(name="node", nodes=[NodeGroup(devices=[DeviceGroup("h100_80g", 4)])],
                   network=NetworkSpec(900.0, 100.0))  # fmt: skip
TABLES = [TableStats(f"t{i}", 200_000, 64, lookups_per_sample=4.0) for i in range(6)] + [
    TableStats("small", 1_000, 32)
]


def _group():
    inputs = inputs_for(NODE, TABLES, batch=2048)
    plan = PLANNERS["hybrid"](inputs)
    return plan, inputs


def test_one_replica_keeps_the_groups_own_all_reduce_and_syncs_nothing() -> None:
    """W = G: the recomputed gradient bytes (dense and replicated rows) price the cost
    model's own all-reduce, and there is no replica to sync with."""
    plan, inputs = _group()
    cost = plan_cost(plan, inputs)
    assert any(s.dp for s in plan.shards())  # replicated rows are part of that all-reduce
    same = two_d_cost(plan, cost, inputs, inputs.world, inputs.network)
    assert same.allreduce_s == pytest.approx(cost.allreduce_s, rel=1e-12)
    assert same.lookup_fwd_s == cost.lookup_fwd_s and same.dense_s == cost.dense_s


def test_replica_sync_counts_touched_rows_less_hot_rows_over_the_group() -> None:
    """A batch large enough to touch every row: each rank syncs the rows not replicated
    already, its 1/G share; with more replicas the step's all-reduce grows."""
    plan, inputs = _group()
    inputs = replace(inputs, global_batch=inputs.world * 10_000_000)
    hot = {t.name: t.replicated_rows for t in plan.tables}
    want = sum((t.rows - hot[t.name]) * t.dim * t.weight_bytes for t in TABLES) / inputs.world
    assert replica_sync_bytes(plan, inputs, 4 * inputs.world) == pytest.approx(want, rel=1e-3)
    cost = plan_cost(plan, inputs)
    two = two_d_cost(plan, cost, inputs, 2 * inputs.world, inputs.network)
    eight = two_d_cost(plan, cost, inputs, 8 * inputs.world, inputs.network)
    sync = replica_sync_bytes(plan, inputs, 8 * inputs.world)
    assert eight.allreduce_s >= allreduce_s(sync, 8, inputs.network) > 0
    assert eight.allreduce_s > two.allreduce_s > cost.allreduce_s


def test_a_group_that_does_not_divide_the_cluster_is_refused() -> None:
    plan, inputs = _group()
    with pytest.raises(ValueError, match="do not divide 6 ranks"):
        two_d_cost(plan, plan_cost(plan, inputs), inputs, 6, inputs.network)
