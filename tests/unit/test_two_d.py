"""Synchronous 2D groups priced (`sharding.two_d`): the replica sync and the all-reduce."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import CALIBRATION_2026_12_06

from sharding.cost_model import allreduce_s
from sharding.plan_eval import evaluate, plan_cost
from sharding.planners import PLANNERS
from sharding.two_d import (
    TwoDGroupError,
    best_with_groups,
    group_inputs,
    group_sizes,
    replica_sync_bytes,
    two_d_cost,
)
from sharding.types import ClusterSpec, DeviceGroup, NetworkSpec, NodeGroup, TableStats
from tests.unit.test_planners import inputs_for

NODE = ClusterSpec(
    name="node",
    nodes=[NodeGroup(devices=[DeviceGroup("h100_80g", 4)])],
    network=NetworkSpec(900.0, 100.0),
)
TABLES = [TableStats(f"t{i}", 200_000, 64, lookups_per_sample=4.0) for i in range(6)] + [
    TableStats("small", 1_000, 32)
]


@pytest.fixture(autouse=True)
def _pinned_host_assembly(monkeypatch) -> None:
    """GPU hosts' batch assembly is priced at the shipped calibration's CPU rate; these
    plans were written against that of 2026-12-06 03:02 (a new one moves hybrid's cuts)."""
    import json

    from sharding import calibration

    rate = json.loads(CALIBRATION_2026_12_06.read_text())["device"]["input_s_per_sample"]
    monkeypatch.setattr(calibration, "host_assembly_s", lambda: rate)


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


def test_replica_sync_counts_each_ranks_touched_rows_less_hot_rows() -> None:
    """A batch large enough to touch every row: each rank syncs the cold rows of its own
    shards (hot rows ride the all-reduce already) with an 8-byte id each, and the step waits
    for the busiest rank; with more replicas the step's all-reduce grows."""
    plan, inputs = _group()
    inputs = replace(inputs, global_batch=inputs.world * 10_000_000)
    per_rank = [0.0] * inputs.world
    for s in plan.shards():
        if not s.dp:
            per_rank[s.rank] += s.rows * (s.cols * 4 + 8)
    assert len({round(b) for b in per_rank}) > 1  # uneven: the busiest rank is what counts
    busiest = replica_sync_bytes(plan, inputs, 4 * inputs.world)
    assert busiest == pytest.approx(max(per_rank), rel=1e-3)
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


def _cluster(nodes: int, inter_gbit_s: float, per_node: int = 4) -> ClusterSpec:
    return ClusterSpec(
        name="nodes",
        nodes=[NodeGroup(count=nodes, devices=[DeviceGroup("h100_80g", per_node)])],
        network=NetworkSpec(900.0, inter_gbit_s),
    )


MULTI_HOT = [TableStats(f"m{i}", 20_000, 128, lookups_per_sample=30.0) for i in range(8)]


def _hybrid(inputs):
    return evaluate(PLANNERS["hybrid"](inputs), inputs)


def test_groups_are_whole_alike_nodes_dividing_the_cluster() -> None:
    """Group sizes: divisors of W that start at node boundaries; a cluster whose nodes are
    not alike, place for place, has none; `group_inputs` is the first G ranks at the same
    batch per rank, and names what is wrong with a size it refuses."""
    inputs = inputs_for(_cluster(6, 100.0), MULTI_HOT)
    assert group_sizes(inputs) == [4, 8, 12]
    assert group_sizes(inputs_for(_cluster(1, 100.0), MULTI_HOT)) == []
    group = group_inputs(inputs, 8)
    assert [r.rank for r in group.ranks] == list(range(8))
    assert group.global_batch * 3 == inputs.global_batch
    with pytest.raises(TwoDGroupError, match="does not divide the 24 ranks"):
        group_inputs(inputs, 5)
    nodes = [NodeGroup(devices=[DeviceGroup(k, 4)]) for k in ("h100_80g", "a100_80g")]
    mixed = ClusterSpec(name="mixed", nodes=nodes, network=NetworkSpec(900.0, 100.0))
    mixed_inputs = inputs_for(mixed, MULTI_HOT)
    assert group_sizes(mixed_inputs) == []
    with pytest.raises(TwoDGroupError, match="rank 4 .* is not like rank 0"):
        group_inputs(mixed_inputs, 4)


def test_the_planner_keeps_2d_groups_only_where_the_step_gains(monkeypatch) -> None:
    """Many multi-hot lookups of small tables across a slow link between nodes: one node's
    group exchanges within it and syncs only touched rows across, and `best_with_groups`
    takes it (a 2D plan, evaluated on the whole cluster: its step is `two_d_cost`'s, its
    bound the cluster's). Across a fast link the plan for every rank stays. A GPU rank's
    batch assembly is this machine's calibrated host time: pinned to 2026-12-04's."""
    from sharding import calibration

    monkeypatch.setattr(calibration, "host_assembly_s", lambda: 1.4077e-06)
    for gbit, wins in ((10.0, True), (100.0, False)):
        inputs = inputs_for(_cluster(8, gbit), MULTI_HOT, batch=4096)
        one = _hybrid(inputs)
        best = best_with_groups(one, inputs, _hybrid)
        assert (best is not one) == wins, (gbit, one.est_step_ms, best.est_step_ms)
        if not wins:
            continue
        g = best.sharding_group_size
        assert g in group_sizes(inputs) and best.est_step_ms < 0.8 * one.est_step_ms
        assert len(best.batch_per_rank) == g and best.lower_bound_ms == one.lower_bound_ms
        group = group_inputs(inputs, g)
        cost = two_d_cost(best, plan_cost(best, group), group, inputs.world, inputs.network)
        assert best.est_step_ms == pytest.approx(1000 * cost.step_s(inputs.schedule))
