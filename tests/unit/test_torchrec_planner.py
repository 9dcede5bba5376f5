"""TorchRec's planner as a fair baseline: told the cluster's capacities and bandwidths,
offered every sharding type and kernel, its plans priced by our cost model."""

from __future__ import annotations

import pytest
import torch
from test_planners import inputs_for

from recsys.models.dlrm import build_model
from sharding.batch_split import equal_batch
from sharding.hybrid import MIN_COLS
from sharding.memory import DENSE_BYTES_PER_PARAM, table_room
from sharding.plan_eval import evaluate
from sharding.plan_shards import plan_from_layout
from sharding.torchrec_planner import (
    CoverageCacheStats,
    TorchRecConfigError,
    cache_load_factor,
    plan_with_torchrec,
    tables_module,
    torchrec_constraints,
    torchrec_plans,
    torchrec_topology,
)
from sharding.types import (
    ClusterSpec,
    DeviceGroup,
    NetworkSpec,
    NodeGroup,
    PlanDoesNotFitError,
    PlannerConfig,
    TableStats,
    Tier,
)

TWO_NODES = ClusterSpec(
    name="two_nodes",
    nodes=[
        NodeGroup(
            count=2,
            host_memory_gib=64,
            devices=[DeviceGroup("a100_40g", 2), DeviceGroup("t4_16g", 2, hbm_gib=8)],
        )
    ],
    network=NetworkSpec(intra_node_gbit_s=300, inter_node_gbit_s=50, latency_us=5),
)


def test_topology_gets_capacities_bandwidths_and_ranks_per_node() -> None:
    inputs = inputs_for(TWO_NODES, [TableStats("t", 1000, 16)])
    topo = torchrec_topology(inputs)
    # told the room every plan is judged against (sharding.memory), not the raw memory
    room = table_room(inputs, equal_batch(inputs.global_batch, inputs.world))
    assert [d.storage.hbm for d in topo.devices] == [int(x) for x in room]
    assert [d.storage.ddr for d in topo.devices] == [int(x) for x in inputs.host_budget()]
    dense = inputs.dense_params * DENSE_BYTES_PER_PARAM
    assert all(
        d.storage.hbm < r.hbm_bytes * 0.85 - dense
        for d, r in zip(topo.devices, inputs.ranks, strict=True)
    )
    assert topo.local_world_size == 4
    # bytes per millisecond, the cluster's own: 300 and 50 Gbit/s, not TorchRec's defaults
    assert topo.intra_host_bw == pytest.approx(300e9 / 8 / 1000)
    assert topo.inter_host_bw == pytest.approx(50e9 / 8 / 1000)
    mean_hbm = sum(r.hbm_gbyte_s for r in inputs.ranks) / inputs.world
    assert topo.hbm_mem_bw == pytest.approx(mean_hbm * 1e9 / 1000)


def test_every_sharding_type_and_kernel_is_offered() -> None:
    inputs = inputs_for(TWO_NODES, [TableStats("wide", 10_000, 128), TableStats("narrow", 50, 16)])
    gpu = torchrec_constraints(inputs, PlannerConfig())
    assert set(gpu["wide"].sharding_types) == {
        "data_parallel",
        "table_wise",
        "column_wise",
        "table_column_wise",
        "row_wise",
        "table_row_wise",
    }
    assert {"fused", "fused_uvm", "fused_uvm_caching", "dense"} == set(gpu["wide"].compute_kernels)
    # the same narrowest column piece as hybrid's
    assert gpu["wide"].min_partition == MIN_COLS == gpu["narrow"].min_partition
    assert gpu["wide"].cache_params.load_factor == pytest.approx(
        cache_load_factor(inputs.coverage["wide"], 10_000)
    )
    inputs.cpu = True
    cpu = torchrec_constraints(inputs, PlannerConfig())
    assert "row_wise" not in cpu["wide"].sharding_types
    assert set(cpu["wide"].compute_kernels) == {"fused", "dense"}
    no_dp = torchrec_constraints(inputs, PlannerConfig(torchrec_data_parallel=False))
    assert "data_parallel" in cpu["wide"].sharding_types
    assert set(no_dp["wide"].sharding_types) == set(cpu["wide"].sharding_types) - {"data_parallel"}


def test_the_sharding_types_can_be_narrowed_to_table_row_wise_the_usual_baseline() -> None:
    """`planner.torchrec_sharding_types=[table_row_wise]` (conf/planner/torchrec_twrw.yaml):
    every table's rows over one node; a type TorchRec cannot choose here is named."""
    tables = [TableStats(f"t{i}", 2_000_000 if i < 4 else 5000, 64, 2.0) for i in range(8)]
    inputs = inputs_for(TWO_NODES, tables)
    twrw = PlannerConfig(torchrec_sharding_types=["table_row_wise"])
    constraints = torchrec_constraints(inputs, twrw)
    assert all(c.sharding_types == ["table_row_wise"] for c in constraints.values())
    inputs.cpu = True
    with pytest.raises(TorchRecConfigError, match=r"\['table_row_wise'\].*may choose"):
        torchrec_constraints(inputs, twrw)


def test_cache_statistics_come_from_the_coverage_curve() -> None:
    cov = lambda k: min(k, 1000) / 1000  # noqa: E731  # uniform access over 1000 rows
    stats = CoverageCacheStats(cov, 1000, lookups_per_step=5000)
    assert stats.expected_miss_rate(0.25) == pytest.approx(0.75)
    assert stats.expected_miss_rate(1.0) == 0.0
    assert stats.cacheability == pytest.approx(0.5, abs=0.01)  # area under 1 - clf
    assert stats.expected_lookups == 1000  # at most the table's rows are distinct
    skewed = lambda k: 0.95 if k >= 10 else 0.0  # noqa: E731
    assert cache_load_factor(skewed, 1000) <= 0.011  # 1% of rows serve 95%


def test_every_plan_torchrec_rated_is_priced_and_its_choice_kept() -> None:
    tables = [TableStats(f"t{i}", 2_000_000 if i < 4 else 5000, 64, 2.0) for i in range(8)]
    inputs = inputs_for(TWO_NODES, tables)
    plans = torchrec_plans(inputs, PlannerConfig())
    assert plans.proposals > 5 and plans.own_estimate_ms > 0
    assert plans.chosen.feasible and plans.chosen.planner == "torchrec"
    assert plans.best_ours.est_step_ms <= plans.chosen.est_step_ms
    assert plans.chosen.batch_per_rank == [1024] * 8  # TorchRec splits the batch equally
    kinds = {t.sharding_type for t in plans.chosen.tables}
    assert kinds <= {
        "data_parallel",
        "table_wise",
        "column_wise",
        "table_column_wise",
        "row_wise",
        "table_row_wise",
    }
    # each rated plan is a layout that our cost model reads back and checks
    for _, layout in plans.result.proposals[:20]:
        plan = plan_from_layout("torchrec", layout, inputs)
        assert {t.name for t in plan.tables} == {t.name for t in tables}
    # the best is what checking every rated plan in full finds: the fastest that fits
    every = [
        evaluate(plan_from_layout("torchrec", x, inputs), inputs, bound=False)
        for _, x in plans.result.proposals
    ]
    fits = [p.est_step_ms for p in every if p.feasible]
    assert fits and plans.best_ours.feasible
    assert plans.best_ours.est_step_ms == min(fits + [plans.chosen.est_step_ms])


@pytest.mark.parametrize("reserve", [0.15, 0.96, 0.97, 0.99])
def test_the_best_rated_plan_is_the_fastest_that_fits_whatever_fits(reserve) -> None:
    """`_fastest` (priced by step, checked fastest first) against checking every rated plan
    in full, with memory reserves under which all of them fit (0.15), some and the first
    (0.96), some but not the first (0.97), none (0.99): the fastest that fits, the first on
    equal steps; where none fits, the fastest."""
    from dataclasses import replace

    from sharding.torchrec_planner import _fastest

    tables = [TableStats(f"t{i}", 2_000_000 if i < 4 else 5000, 64, 2.0) for i in range(8)]
    inputs = inputs_for(TWO_NODES, tables)
    rated = torchrec_plans(inputs, PlannerConfig()).result.proposals
    tight = replace(inputs, reserve=reserve)
    layouts = [x for _, x in rated]
    chosen = evaluate(plan_from_layout("torchrec", layouts[0], tight), tight)
    every = [evaluate(plan_from_layout("torchrec", x, tight), tight, bound=False) for x in layouts]
    want = chosen
    for plan in every:
        if (plan.feasible, -plan.est_step_ms) > (want.feasible, -want.est_step_ms):
            want = plan
    got = _fastest(chosen, layouts, tight)
    assert (got.feasible, got.est_step_ms) == (want.feasible, want.est_step_ms)
    assert [t.shards for t in got.tables] == [t.shards for t in want.tables]


def test_memoized_estimator_lookups_leave_torchrecs_estimates_and_choice_unchanged(
    monkeypatch,
) -> None:
    """`memoize_estimator_lookups` (TorchRec 1.9.2 scans `dir(config)` per estimate): every
    plan TorchRec rates, its own estimate of each and its choice, the same as with its own
    lookups, which it then scans a small fraction as often."""
    from torchrec.distributed.planner.estimator import annotations

    from sharding.torchrec_planner import memoize_estimator_lookups

    scans = {"n": 0}
    own = {}  # TorchRec's lookups, under any memoizing an earlier test did
    for name in ("_get_annotated_method", "_get_coefficient_method"):
        own[name] = getattr(annotations, name)
        while getattr(own[name], "memoized", False):
            own[name] = own[name].original

    def counted(lookup):
        def scan(*args):
            scans["n"] += 1
            return lookup(*args)

        return scan

    tables = [TableStats(f"t{i}", 2_000_000 if i < 3 else 5000, 64, 2.0) for i in range(6)]
    inputs = inputs_for(TWO_NODES, tables)
    runs = []
    for memoize in (True, False):
        for name, lookup in own.items():
            monkeypatch.setattr(annotations, name, counted(lookup))
        if memoize:
            memoize_estimator_lookups()
        else:  # TorchRec's lookups as they come
            monkeypatch.setattr("sharding.torchrec_planner.memoize_estimator_lookups", lambda: None)
        scans["n"] = 0
        runs.append(
            (plan_with_torchrec(tables_module(inputs), inputs, PlannerConfig()), scans["n"])
        )
    (fast, fast_scans), (slow, slow_scans) = runs
    assert fast.proposals == slow.proposals and fast.own_estimate_ms == slow.own_estimate_ms
    assert str(fast.plan) == str(slow.plan)
    assert 0 < 10 * fast_scans < slow_scans


def test_uvm_caching_shards_hold_their_cache_in_hbm_and_miss_at_host_speed() -> None:
    inputs = inputs_for(TWO_NODES, [TableStats("t", 1_000_000, 64)])
    layout = [
        {
            "table": "t",
            "sharding_type": "table_wise",
            "compute_kernel": "fused_uvm_caching",
            "cache_load_factor": 0.01,
            "shards": [{"rank": 0, "rows": 1_000_000, "cols": 64}],
        }
    ]
    plan = plan_from_layout("torchrec", layout, inputs)
    (shard,) = plan.tables[0].shards
    assert shard.tier == Tier.cached and shard.cache_rows == 10_000
    assert shard.hit_rate == pytest.approx(inputs.coverage["t"](10_000))
    from sharding.plan_eval import evaluate

    evaluate(plan, inputs)
    rank0 = plan.devices[0]
    parts = rank0["hbm_parts_bytes"]
    assert parts["tables"] == 10_000 * 64 * 4  # of the table, the cache only
    assert rank0["hbm_used_bytes"] == pytest.approx(sum(parts.values()))
    assert rank0["host_used_bytes"] >= 1_000_000 * 64 * 4  # the whole table


def test_plan_that_cannot_fit_names_every_rank_and_the_fix(typed_cfg) -> None:
    from recsys.app.planning import plan_inputs

    cfg = typed_cfg(["model=dcnv2_mlperf"])  # 2 CPU ranks of 0.5 GiB: ~97 GiB of tables
    inputs = plan_inputs(cfg, None, None)
    model = build_model(cfg.model, dense_device=torch.device("meta"))
    with pytest.raises(PlanDoesNotFitError) as e:
        plan_with_torchrec(model, inputs, PlannerConfig())
    msg = str(e.value)
    assert "rank 0 (cpu): 0.50 GiB" in msg and "rank 1 (cpu)" in msg
    assert "cluster=" in msg and "model=" in msg


def test_gpus_with_no_room_for_tables_get_no_plan_not_a_torchrec_crash() -> None:
    """Dense parameters larger than every GPU's memory leave no room anywhere: TorchRec is
    told a byte per device (its row-wise sizing divides by their sum) and finds no plan."""
    from dataclasses import replace

    inputs = replace(inputs_for(TWO_NODES, [TableStats("t", 159, 128)]), dense_params=10**10)
    assert max(table_room(inputs, equal_batch(inputs.global_batch, inputs.world))) <= 0
    assert [d.storage.hbm for d in torchrec_topology(inputs).devices] == [1] * inputs.world
    with pytest.raises(PlanDoesNotFitError, match="INSUFFICIENT_STORAGE"):
        torchrec_plans(inputs, PlannerConfig(torchrec_timeout_s=5))


def test_mlperf_tables_plan_on_meta_for_a_gpu_node(typed_cfg) -> None:
    from recsys.app.planning import plan_inputs

    # planning on the meta device is what is tested: pieces no narrower than 32 columns keep
    # TorchRec's search (run twice) short; the narrow pieces are offered elsewhere here
    cfg = typed_cfg(["experiment=mlperf_plan_a100", "planner.torchrec_min_partition=32"])
    inputs = plan_inputs(cfg, None, None)
    model = build_model(cfg.model, dense_device=torch.device("meta"))
    plan = plan_with_torchrec(model, inputs, cfg.planner).plan
    sharding = plan.plan["model.sparse_arch.embedding_bag_collection"]
    assert len(sharding) == 26
    used = {r for ps in sharding.values() for r in (ps.ranks or [])}
    assert used <= set(range(8)) and len(used) > 1
    bare = plan_with_torchrec(tables_module(inputs), inputs, cfg.planner).plan
    assert sorted(bare.plan[""]) == sorted(sharding)  # the same tables, planned alike
