"""Inputs that describe no real training step, and plans that do not hold every table
exactly once, are refused with one line naming what and where, before anything is priced."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planners import inputs_for

from recsys.app.planning import PlanConfigError, check_profile, plan_inputs
from sharding.access_profile import build_profile
from sharding.plan_check import MalformedPlanError, PlanInputError, check_inputs
from sharding.plan_eval import evaluate
from sharding.planners import PLANNERS
from sharding.types import (
    ALL_RANKS,
    ClusterSpec,
    DeviceGroup,
    LinkCost,
    NetworkCost,
    NetworkSpec,
    NodeGroup,
    Plan,
    Shard,
    TablePlan,
    TableStats,
)

# the links every GPU layout here is planned on (a cluster must give its own)
NET = NetworkSpec(intra_node_gbit_s=100.0, inter_node_gbit_s=25.0)

SPEC = ClusterSpec(network=NET, name="two", nodes=[NodeGroup(devices=[DeviceGroup("a100_80g", 2)])])


TABLES = [TableStats("a", 1000, 8), TableStats("b", 500, 8)]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.batch_size=0", "trainer.batch_size must be >= 1"),
        ("trainer.batch_size=-5", "trainer.batch_size must be >= 1"),
        ("planner.storage_reservation=-1", "planner.storage_reservation"),
        ("planner.storage_reservation=1.0", "must lie in [0, 1)"),
        ("planner.torchrec_min_partition=2", "torchrec_min_partition"),
        ("dataset.zipf_exponent=-1", "dataset.zipf_exponent must be a finite number > 0"),
        ("dataset.zipf_exponent=0", "dataset.zipf_exponent must be a finite number > 0"),
    ],
)
def test_config_keys_the_planner_cannot_use_are_named(typed_cfg, override, needle) -> None:
    with pytest.raises(PlanConfigError) as e:
        plan_inputs(typed_cfg([override, "cluster=hetero_3node"]), None, None)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(global_batch=1), "leaves some of the 2 ranks without a sample"),
        (dict(reserve=1.5), "must lie in [0, 1)"),
        (dict(network=NetworkCost(LinkCost(-1e-3, 1e9), LinkCost(1e-5, 1e9))), "latency"),
        (dict(network=NetworkCost(LinkCost(1e-5, 0.0), LinkCost(1e-5, 1e9))), "bandwidth"),
        (dict(tables=TABLES + [TableStats("a", 10, 8)]), "listed twice"),
        (dict(tables=[TableStats("z", 0, 8)]), "rows and dim must be >= 1"),
        (dict(micro_batches=0), "micro_batches"),
    ],
)
def test_planner_inputs_that_describe_no_step_are_refused(change, needle) -> None:
    inputs = replace(inputs_for(SPEC, TABLES), **change)
    if "tables" in change:
        inputs.coverage |= {
            t.name: inputs.coverage.get(t.name, lambda k: 0.0) for t in inputs.tables
        }
    with pytest.raises(PlanInputError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        check_inputs(inputs)
    with pytest.raises(PlanInputError):
        PLANNERS["hybrid"](inputs)


def _plan(*tables: TablePlan) -> Plan:
    return Plan("hand", "two", list(tables), [1024, 1024])


def _whole(name: str, rows: int, shards: list[Shard], h: int = 0, parts: int = 1) -> TablePlan:
    return TablePlan(name, rows, 8, "", [], shards[0].tier, h, h, shards, cold_parts=parts)


B = _whole("b", 500, [Shard("b", 1, 500, 8)])


@pytest.mark.parametrize(
    "a,needle",
    [
        (
            _whole("a", 1000, [Shard("a", 0, 1000, 8), Shard("a", 1, 1000, 8)]),
            "not held exactly once",
        ),
        (_whole("a", 1000, [Shard("a", 0, 600, 8)]), "not held exactly once"),  # rows never held
        (_whole("a", 1000, [Shard("a", 5, 1000, 8)]), "rank 5"),
        (_whole("a", 1000, [Shard("a", 0, 1000, 8, sparse_exchange=True)]), "no hot part"),
        (
            _whole(
                "a",
                1000,
                [Shard("a", ALL_RANKS, 100, 8, dp=True, lookup_share=0.6), Shard("a", 0, 900, 8)],
                h=100,
            ),
            "lookup shares",
        ),  # cold: no share
        (
            _whole(
                "a",
                1000,
                [
                    Shard("a", ALL_RANKS, 100, 8, dp=True, lookup_share=0.6),
                    Shard("a", 0, 900, 8, lookup_share=0.9),
                ],
                h=100,
            ),
            "!= 1",
        ),
        (
            _whole("a", 1000, [Shard("a", 0, 600, 8), Shard("a", 1, 400, 8)], parts=2),
            "row parts",
        ),
    ],
)
def test_malformed_plans_are_refused_not_priced(a: TablePlan, needle: str) -> None:
    inputs = inputs_for(SPEC, TABLES)
    with pytest.raises(MalformedPlanError, match=needle):
        evaluate(_plan(a, B), inputs)


def test_a_plan_must_hold_each_table_once_with_a_sample_per_rank() -> None:
    inputs = inputs_for(SPEC, TABLES)
    good = _whole("a", 1000, [Shard("a", 0, 1000, 8)])
    evaluate(_plan(good, B), inputs)  # the well-formed plan prices
    with pytest.raises(MalformedPlanError, match="missing"):
        evaluate(_plan(good), inputs)
    bad_batch = _plan(good, B)
    bad_batch.batch_per_rank = [2048, 0]
    with pytest.raises(MalformedPlanError, match="batch_per_rank"):
        evaluate(bad_batch, inputs)
    # a checked placement re-priced with another split (the planners' batch search) still
    # has its split checked
    with pytest.raises(MalformedPlanError, match="batch_per_rank"):
        evaluate(bad_batch, inputs, check_tables=False)


def test_a_profile_of_another_model_is_refused() -> None:
    ids = {"t_cat_0": [[0, 1, 2]], "t_cat_1": [[3]]}
    profile = build_profile(
        [(1, {k: v[0] for k, v in ids.items()})], {"t_cat_0": 1460, "t_cat_1": 5}
    )
    model = [
        TableStats("t_cat_0", 40_000_000, 128),
        TableStats("t_cat_1", 5, 128),
        TableStats("t_cat_2", 10, 128),
    ]
    with pytest.raises(PlanConfigError) as e:
        check_profile(profile, model, "p.json")
    msg = str(e.value)
    assert "missing ['t_cat_2']" in msg and "t_cat_0: 1,460 rows profiled, 40,000,000" in msg
    assert "sharding.profile" in msg


def test_multi_hot_bags_set_the_planners_lookups_per_sample(typed_cfg) -> None:
    """Without a profile the planner prices each table at its bag size (0: no lookups);
    a profile of multi-hot data measures the same."""
    from recsys.data.source import build_source
    from recsys.models.dlrm import feature_names

    hotness = [0, 3] + [1] * 23 + [7]
    cfg = typed_cfg(["debug=tiny", f"dataset.hotness=[{','.join(map(str, hotness))}]"])
    inputs = plan_inputs(cfg, None, None)
    assert [t.lookups_per_sample for t in inputs.tables] == hotness
    source = build_source(cfg.dataset, cfg.model, 32, 1)
    batches = (
        (32, {f"t_{n}": b.sparse_features[n].values().numpy() for n in feature_names(cfg.model)})
        for b in source.batches("train", 0, 4, 0)
    )
    rows = {t.name: t.rows for t in inputs.tables}
    profile = build_profile(batches, rows)
    assert [t.lookups_per_sample for t in profile.tables] == hotness
