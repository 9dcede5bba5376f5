"""Planners: every row placed once, no capacity exceeded, the bound holds, clear errors."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharding.batch_split import capped_batch, capped_time, proportional_batch
from sharding.cluster import resolve_cluster
from sharding.emit import to_torchrec_plan
from sharding.memory import table_room
from sharding.plan_eval import evaluate
from sharding.planners import PLANNERS
from sharding.row_parts import cold_part_rows
from sharding.types import (
    ALL_RANKS,
    ClusterSpec,
    DeviceGroup,
    NetworkSpec,
    NodeGroup,
    OptimizerState,
    Plan,
    PlanDoesNotFitError,
    PlanInputs,
    PlannerConfig,
    PowerLawCoverage,
    Schedule,
    Shard,
    TablePlan,
    TableStats,
    Tier,
)

# the links every GPU layout here is planned on (a cluster must give its own)
NET = NetworkSpec(intra_node_gbit_s=100.0, inter_node_gbit_s=25.0)

KINDS = ["h100_80g", "a100_40g", "v100_16g", "t4_16g", "l4_24g"]


def inputs_for(spec: ClusterSpec, tables: list[TableStats], batch: int = 1024) -> PlanInputs:
    from sharding.calibration import device_costs, network_cost

    ranks = resolve_cluster(spec)
    return PlanInputs(
        tables=tables,
        coverage={t.name: PowerLawCoverage(t.rows, 1.1) for t in tables},
        ranks=ranks,
        devices=device_costs(ranks, None),
        network=network_cost(spec, ranks, None, None),
        global_batch=batch * len(ranks),
        dense_params=500_000,
        schedule=Schedule.sparse_dist,
        cluster=spec.name,
    )


clusters = st.builds(
    lambda groups, gbps, allreduce, latency: ClusterSpec(
        name="random",
        nodes=[
            NodeGroup(
                count=c,
                host_memory_gib=h,
                devices=[DeviceGroup(k, n, hbm_gib=m)],
                intra_node_gbit_s=link,
            )
            for c, h, k, n, m, link in groups
        ],
        network=NetworkSpec(
            intra_node_gbit_s=100.0, inter_node_gbit_s=gbps, latency_us=latency, allreduce=allreduce
        ),
    ),
    st.lists(
        st.tuples(
            st.integers(1, 2),
            st.floats(1, 64),
            st.sampled_from(KINDS),
            st.integers(1, 4),
            st.floats(0.05, 2.0),
            st.one_of(st.none(), st.floats(16, 3600)),  # the group's own link (PCIe, NVLink)
        ),
        min_size=1,
        max_size=3,
    ),
    st.floats(10, 400),
    st.sampled_from(["ring", "nccl"]),  # every all-reduce the cost model knows
    st.floats(1, 50),
)


table_lists = st.lists(
    st.tuples(st.integers(1, 3_000_000), st.sampled_from([4, 8, 16, 32, 64, 128])),
    min_size=1,
    max_size=25,
).map(lambda ts: [TableStats(f"t{i}", r, d) for i, (r, d) in enumerate(ts)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=clusters, tables=table_lists, planner=st.sampled_from(sorted(PLANNERS)))
def test_plans_never_exceed_capacity_and_place_every_row_once(spec, tables, planner) -> None:
    inputs = inputs_for(spec, tables)
    try:
        plan = evaluate(PLANNERS[planner](inputs), inputs)
    except PlanDoesNotFitError as e:
        assert "GiB" in str(e)
        return
    assert plan.feasible
    for d in plan.devices:
        assert d["hbm_used_bytes"] <= d["hbm_cap_bytes"] + 1
        assert d["host_used_bytes"] <= d["host_cap_bytes"] + 1
    for t, tp in zip(tables, plan.tables, strict=True):
        cold = [s for s in tp.shards if not s.dp]
        hot = [s for s in tp.shards if s.dp]
        assert all(s.rows == tp.replicated_rows for s in hot)
        assert len(hot) in (0, 1)
        if tp.cold_parts > 1:  # row parts: each cold row in one part, all its columns
            assert [s.rows for s in cold] == cold_part_rows(
                t.rows - tp.replicated_rows, tp.cold_parts
            )
            assert all(s.cols == t.dim for s in cold)
        elif cold and cold[0].node_reduce:  # table-row-wise: row blocks, one per rank
            assert sum(s.rows for s in cold) == t.rows and all(s.cols == t.dim for s in cold)
            assert len({s.rank for s in cold}) == len(cold)
        elif cold:  # every column of every cold row on exactly one rank
            assert tp.replicated_rows + cold[0].rows == t.rows
            assert sum(s.cols for s in cold) == t.dim
            assert len({s.rows for s in cold}) == 1
        else:
            assert tp.replicated_rows == t.rows
    assert sum(plan.batch_per_rank) == inputs.global_batch
    assert plan.lower_bound_ms <= plan.est_step_ms * (1 + 1e-9)


def _random_table_plan(t: TableStats, inputs: PlanInputs, data, cold_only: bool) -> TablePlan:
    """Any valid way to hold one table: replicated hot rows, then column pieces, row parts
    (cold or whole), TorchRec-style row pieces or a table-row-wise group on one node, in
    any memory tier, on any ranks (memory ignored, which the bound also ignores)."""
    w = inputs.world
    h = data.draw(st.integers(0, t.rows)) if w > 1 else 0
    cov = inputs.coverage[t.name](h) if h else 0.0
    hot = [Shard(t.name, ALL_RANKS, h, t.dim, dp=True, lookup_share=cov)] if h else []
    tp = TablePlan(t.name, t.rows, t.dim, "random", [], Tier.hbm, h, h, hot)
    if h == t.rows:
        return tp
    cold_rows = t.rows - h
    layouts = ["columns", "row_parts"] + (["row_pieces", "node_group"] if h == 0 else [])
    layout = data.draw(st.sampled_from(layouts))
    sparse = cold_only and h > 0 and data.draw(st.booleans())

    def shard(rank: int, rows: int, cols: int, share: float | None, **kw) -> Shard:
        tier = data.draw(st.sampled_from(list(Tier)))
        hit = data.draw(st.floats(0, 1)) if tier == Tier.cached else 1.0
        return Shard(
            t.name,
            rank,
            rows,
            cols,
            tier,
            hit_rate=hit,
            lookup_share=share,
            sparse_exchange=sparse,
            **kw,
        )

    rank = st.integers(0, w - 1)
    if layout == "columns":
        cut = sorted(
            data.draw(st.lists(st.sampled_from(range(1, t.dim)), max_size=3, unique=True))
            if t.dim > 1
            else []
        )
        for lo, hi in zip([0, *cut], [*cut, t.dim], strict=True):
            tp.shards.append(shard(data.draw(rank), cold_rows, hi - lo, 1 - cov))
    elif layout == "row_parts":
        tp.cold_parts = data.draw(st.integers(1, min(4, cold_rows)))
        for rows in cold_part_rows(cold_rows, tp.cold_parts):
            tp.shards.append(shard(data.draw(rank), rows, t.dim, (1 - cov) * rows / cold_rows))
    elif layout == "row_pieces":  # TorchRec's row-wise: any ranks, rows summing up
        k = data.draw(st.integers(1, min(w, cold_rows)))
        rows = [cold_rows // k + (1 if j < cold_rows % k else 0) for j in range(k)]
        tp.shards += [shard(data.draw(rank), n, t.dim, None) for n in rows]
    else:  # table-row-wise: row pieces on distinct ranks, partial sums reduced per node
        mine = data.draw(st.lists(rank, min_size=1, max_size=min(w, cold_rows), unique=True))
        k = len(mine)
        rows = [cold_rows // k + (1 if j < cold_rows % k else 0) for j in range(k)]
        tp.shards += [
            shard(r, n, t.dim, None, node_reduce=True) for r, n in zip(mine, rows, strict=True)
        ]
    return tp


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=clusters,
    tables=table_lists,
    data=st.data(),
    schedule=st.sampled_from(list(Schedule)),
    cold_only=st.booleans(),
)
def test_no_plan_steps_faster_than_the_lower_bound(spec, tables, data, schedule, cold_only):
    """Random plans (any batch split down to 1 sample, hot rows, sharding, row parts, tiers,
    table-row-wise groups, placement) never beat the bound: a bound, not an estimate."""
    tables = [
        TableStats(t.name, t.rows, t.dim, data.draw(st.sampled_from([1.0, 1.5, 8.0])))
        for t in tables
    ]
    inputs = inputs_for(spec, tables)
    inputs.schedule, inputs.micro_batches = schedule, data.draw(st.integers(1, 8))
    inputs.cold_only_exchange = cold_only
    w, big_b = inputs.world, inputs.global_batch
    weights = data.draw(st.lists(st.floats(1e-4, 1), min_size=w, max_size=w))
    batch = proportional_batch(big_b, weights)
    plans = [_random_table_plan(t, inputs, data, cold_only) for t in tables]
    plan = evaluate(Plan("random", spec.name, plans, batch), inputs)
    assert plan.lower_bound_ms <= plan.est_step_ms * (1 + 1e-9)


def test_batch_split_follows_device_speed_and_sums_up() -> None:
    assert proportional_batch(10, [1, 1]) == [5, 5]
    assert proportional_batch(100, [3, 1]) == [75, 25]
    assert sum(proportional_batch(1001, [0.7, 0.2, 0.1])) == 1001
    assert min(proportional_batch(4, [1000, 1, 1])) >= 1


def test_capped_batch_fills_slower_ranks_in_proportion_up_to_the_cap() -> None:
    sample_s = np.array([1.0, 1.0, 4.0, 4.0])  # two ranks 4x faster
    assert capped_batch(1000, sample_s, 10_000) == proportional_batch(1000, [4, 4, 1, 1])
    capped = capped_batch(1000, sample_s, 300)
    assert capped == [300, 300, 200, 200] and sum(capped) == 1000
    assert capped_batch(1000, sample_s, 1) == [250] * 4  # never below an equal share
    t = capped_time(1000, sample_s, np.array([300.0, 400.0]))
    assert t == pytest.approx([800.0, 400.0])  # the slow ranks' 200 x 4 s; uncapped 400 s


def test_hybrid_caps_fast_ranks_batch_where_their_exchange_would_cost_more() -> None:
    """Across a slow link the H100s' speed-proportional shares (15x the T4s') would make
    them receive most of the exchange; capped shares plan faster."""
    from sharding.hybrid import HybridOptions, _hybrid

    spec = ClusterSpec(
        name="mix",
        network=NetworkSpec(5, 25.0),
        nodes=[NodeGroup(devices=[DeviceGroup("h100_80g", 2), DeviceGroup("t4_16g", 2)])],
    )
    inputs = inputs_for(spec, [TableStats(f"t{i}", 100_000, 128) for i in range(26)])
    speed = proportional_batch(inputs.global_batch, [d.dense_flops_per_s for d in inputs.devices])
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert max(plan.batch_per_rank) < max(speed) and sum(plan.batch_per_rank) == sum(speed)
    assert plan.est_step_ms < evaluate(_hybrid(inputs, speed, HybridOptions()), inputs).est_step_ms


def _two_h100s_two_t4s() -> PlanInputs:
    """Two H100s and two T4s on one node, eight large tables and a tiny one."""
    mixed = [DeviceGroup("h100_80g", 2), DeviceGroup("t4_16g", 2)]
    spec = ClusterSpec(name="mix", nodes=[NodeGroup(devices=mixed)], network=NetworkSpec(25, 25.0))
    tables = [TableStats(f"t{i}", 1_000_000, 64) for i in range(8)] + [TableStats("tiny", 10, 64)]
    return inputs_for(spec, tables)


def test_hybrid_gives_fast_devices_more_batch_and_replicates_hot_rows() -> None:
    inputs = _two_h100s_two_t4s()
    inputs.cold_only_exchange = False
    pooled = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert not any(0 < t.replicated_rows < t.rows for t in pooled.tables)  # nothing to gain
    inputs.cold_only_exchange = True
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    h100, t4 = plan.batch_per_rank[0], plan.batch_per_rank[3]
    assert h100 > 2 * t4  # speed-aware (capped where the exchange would cost more)
    tiny = next(t for t in plan.tables if t.name == "tiny")
    assert tiny.sharding_type == "data_parallel" and tiny.replicated_rows == 10
    assert any(0 < t.replicated_rows < t.rows for t in plan.tables)  # a hot/cold split
    blind = evaluate(PLANNERS["greedy_size"](inputs), inputs)
    assert plan.est_step_ms < blind.est_step_ms
    assert plan.a2a_bytes_per_step < blind.a2a_bytes_per_step


def test_hybrid_keeps_tables_whole_where_their_split_costs_more_than_it_saves() -> None:
    """The same cluster as above, each split table priced 50 ms a step of CPU work (the
    remap, its keys: `split_s_per_table`): no table is split, and the plan prices none."""
    inputs = _two_h100s_two_t4s()
    split = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert any(0 < t.replicated_rows < t.rows for t in split.tables)
    inputs.devices = [replace(d, split_s_per_table=0.05) for d in inputs.devices]
    whole = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert not any(0 < t.replicated_rows < t.rows for t in whole.tables)
    assert whole.step_parts_ms["split tables"] == 0.0
    # the split plan, priced with that work, steps slower than the plan kept whole
    assert evaluate(split, inputs).est_step_ms > whole.est_step_ms


def test_hybrid_replicates_no_hot_rows_of_a_table_never_looked_up() -> None:
    """The same cluster and tables with one table's bags always empty: its hot rows save no
    exchange (cold ids travel per lookup), so it is not split; the others still are."""
    from dataclasses import replace

    mixed = [DeviceGroup("h100_80g", 2), DeviceGroup("t4_16g", 2)]
    spec = ClusterSpec(name="mix", nodes=[NodeGroup(devices=mixed)], network=NetworkSpec(25, 25.0))
    tables = [TableStats(f"t{i}", 1_000_000, 64) for i in range(8)]
    inputs = inputs_for(spec, tables)
    split = {t.name for t in PLANNERS["hybrid"](inputs).tables if 0 < t.replicated_rows < t.rows}
    assert "t0" in split, split
    inputs.tables = [replace(t, lookups_per_sample=0.0) if t.name == "t0" else t for t in tables]
    plan = PLANNERS["hybrid"](inputs)
    t0 = next(t for t in plan.tables if t.name == "t0")
    assert not 0 < t0.replicated_rows < t0.rows
    assert any(0 < t.replicated_rows < t.rows for t in plan.tables)


def test_hybrid_cuts_a_lone_tables_cold_part_in_row_parts_over_the_ranks() -> None:
    """One big table: whole on one rank its cold part would unbalance the exchange; in row
    parts on both ranks it beats keeping the table whole (column-split over both)."""
    spec = ClusterSpec(
        name="two",
        nodes=[NodeGroup(devices=[DeviceGroup("a100_80g", 2)])],
        network=NetworkSpec(5, 25.0),
    )
    inputs = inputs_for(spec, [TableStats("t0", 2_000_000, 64)], batch=8192)
    # placement alone: at 8,192 samples a rank, assembling the batch on the host would set
    # every plan's step (a floor under SparseDist), hiding what the placement changes
    inputs.devices = [replace(d, host_s_per_sample=0.0) for d in inputs.devices]
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    t0 = plan.tables[0]
    assert 0 < t0.replicated_rows < t0.rows and t0.cold_parts == 2
    assert sorted(s.rank for s in t0.shards if not s.dp) == [0, 1]
    cold = to_torchrec_plan(plan, {"t0": "f0"}, "cuda").plan[
        "model.sparse_arch.embedding_collection"
    ]
    assert sorted(cold) == ["t0_cold0", "t0_cold1"]  # each table-wise on its part's rank
    assert [cold[f"t0_cold{j}"].ranks for j in range(2)] == [[s.rank] for s in t0.shards[-2:]]
    inputs.cold_only_exchange = False
    whole = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert whole.tables[0].sharding_type == "column_wise"
    assert plan.est_step_ms < whole.est_step_ms


def test_hybrid_splits_tables_only_where_the_sequence_work_pays() -> None:
    """Splitting a table sends fewer bytes but costs CPU per cold lookup: with a costly
    sequence exchange the hybrid plan keeps tables whole, and it predicts no worse."""
    from dataclasses import replace

    spec = ClusterSpec(
        name="two",
        nodes=[NodeGroup(devices=[DeviceGroup("h100_80g", 2)])],
        network=NetworkSpec(5, 25.0),
    )
    tables = [TableStats(f"t{i}", 1_000_000, 64) for i in range(4)]
    inputs = inputs_for(spec, tables, batch=8192)
    cheap = PLANNERS["hybrid"](inputs)
    assert any(0 < t.replicated_rows < t.rows for t in cheap.tables)
    inputs.devices = [replace(d, sequence_s_per_lookup=1e-5) for d in inputs.devices]
    costly = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert not any(0 < t.replicated_rows < t.rows for t in costly.tables)
    assert costly.est_step_ms <= evaluate(cheap, inputs).est_step_ms


def test_too_big_names_devices_shortfall_and_largest_tables() -> None:
    node = NodeGroup(host_memory_gib=1, devices=[DeviceGroup("t4_16g", 2)])
    spec = ClusterSpec(network=NET, name="small", nodes=[node])
    tables = [TableStats("huge", 400_000_000, 128), TableStats("small", 100, 8)]
    with pytest.raises(PlanDoesNotFitError) as e:
        PLANNERS["hybrid"](inputs_for(spec, tables))
    msg = str(e.value)
    assert "rank 0 (t4_16g)" in msg and "rank 1 (t4_16g)" in msg and "short" in msg
    assert msg.index("huge (400,000,000 x 128") < msg.index("small (100 x 8")
    assert "Fix:" in msg


def test_optimizer_state_counts_against_capacity() -> None:
    node = NodeGroup(host_memory_gib=0.001, devices=[DeviceGroup("t4_16g", 1, hbm_gib=1)])
    spec = ClusterSpec(network=NET, name="one", nodes=[node])
    inputs = inputs_for(spec, [TableStats("t", 1, 64)])
    # the room the dense part and the batch leave, less the table's buffers (sharding.memory)
    room = table_room(inputs, [inputs.global_batch])[0]
    room -= inputs.global_batch * (8 + 4 + 2 * 64 * 4)
    rows = int(room / (64 * 4 + 4)) - 10  # weights + row-wise Adagrad just fit
    inputs = inputs_for(spec, [TableStats("t", rows, 64)])
    PLANNERS["round_robin"](inputs)
    inputs.dense_params *= 2  # the dense part's state counts too
    with pytest.raises(PlanDoesNotFitError):
        PLANNERS["round_robin"](inputs)
    inputs.dense_params //= 2
    inputs.optimizer = OptimizerState(per_row_bytes=0, per_value_bytes=8)  # Adam: 3x
    with pytest.raises(PlanDoesNotFitError):
        PLANNERS["round_robin"](inputs)


def test_hybrid_plan_becomes_a_torchrec_plan_with_split_tables() -> None:
    spec = ClusterSpec(
        name="two",
        nodes=[NodeGroup(devices=[DeviceGroup("a100_80g", 2)])],
        network=NetworkSpec(5, 25.0),
    )
    # four big tables: their cold parts balance over the ranks, so splitting pays (one
    # alone would sit whole on one rank, and the planner keeps the table whole instead)
    tables = [TableStats(f"t_cat_{i}", 2_000_000, 64) for i in range(4)]
    tables.append(TableStats("t_cat_4", 50, 64))
    features = {t.name: t.name[len("t_") :] for t in tables}
    inputs = inputs_for(spec, tables)
    inputs.cold_only_exchange = True
    plan = PLANNERS["hybrid"](inputs)
    split = next(t for t in plan.tables if t.name == "t_cat_0")
    assert 0 < split.replicated_rows < split.rows
    text = str(to_torchrec_plan(plan, features, "cuda"))
    assert "t_cat_0_hot" in text and "t_cat_0_cold" in text and "data_parallel" in text
    sequences = to_torchrec_plan(plan, features, "cuda")
    cold_module = sequences.plan["model.sparse_arch.embedding_collection"]
    # each big table's cold rows: one `_cold` table, or `_cold<j>` row parts
    cold = {f"t_cat_{i}": [] for i in range(4)}
    for name in cold_module:
        cold[name.rsplit("_cold", 1)[0]].append(name)
    for t in plan.tables[:4]:
        parts = [f"{t.name}_cold{j}" for j in range(t.cold_parts)]
        assert sorted(cold[t.name]) == (parts if t.cold_parts > 1 else [f"{t.name}_cold"])
    bags = sequences.plan["model.sparse_arch.embedding_bag_collection"]
    assert not any("_cold" in name for name in bags)
    # a cold part that keeps the pooled exchange stays a bag beside the sequence ones
    first = plan.tables[0]
    pooled = replace(first, shards=[replace(s, sparse_exchange=False) for s in first.shards])
    mixed = to_torchrec_plan(replace(plan, tables=[pooled, *plan.tables[1:]]), features, "cuda")
    bags = mixed.plan["model.sparse_arch.embedding_bag_collection"]
    cold_module = mixed.plan["model.sparse_arch.embedding_collection"]
    assert {n for n in bags if "_cold" in n} == {n for n in cold[first.name]}
    assert not any(n.startswith(first.name + "_") for n in cold_module) and len(cold_module) > 0


def test_mlperf_tables_on_64_mixed_devices_plan_fast(typed_cfg) -> None:
    import recsys.app.planning as cli

    base = ["cluster=hetero_64", "model=dcnv2_mlperf", "trainer.batch_size=1024"]
    cfg = typed_cfg([*base, "planner=hybrid", "planner.leave_out=false"])
    inputs = cli.plan_inputs(cfg, None, None)
    cpu = time.process_time()
    plan = cli.make_plan(cfg, inputs)
    cpu = time.process_time() - cpu
    # the goal, under 0.5 s, is measured by benchmarks.planners; this guards against a gross
    # regression (half as slow again as today: 1.96-2.02 CPU seconds on 2026-12-07's host,
    # where 2.0 failed the code of the day before alike). CPU seconds, not the wall clock: a
    # busy machine (the suite's other worker) stretches the one, not the other
    assert plan.feasible and cpu < 3.0
    assert plan.est_step_ms <= 1.5 * plan.lower_bound_ms
    # weighing parts of the cluster (the default) plans only those whose bound could win:
    # three of its nine here, about twice the time
    weighing = typed_cfg([*base, "planner=hybrid"])
    cpu = time.process_time()
    weighed = cli.make_plan(weighing, inputs)
    cpu = time.process_time() - cpu
    assert weighed.est_step_ms <= plan.est_step_ms and cpu < 7.0
    assert sum("est_step_ms" in w for w in weighed.weighed) <= 5


def test_multi_hot_tables_replicate_hot_rows_before_a_pooled_cold_part(typed_cfg) -> None:
    """MLPerf's multi-hot bags on 64 H100s: a table's pieces (at most one a rank) cannot
    spread 100 lookups a sample; its hottest rows replicated make their lookups local on
    every rank while the cold rest keeps the pooled exchange (exchanged per lookup it would
    send up to 100 vectors a sample). Faster than hot parts only before cold parts exchanged
    alone (measured: 27.12 ms against 29.23)."""
    from recsys.app.planning import plan_inputs
    from recsys.data.multi_hot import MLPERF_HOTNESS
    from sharding.hybrid import HybridOptions, hybrid

    cfg = typed_cfg(["cluster=2x8_h100", "model=dcnv2_mlperf", "trainer.batch_size=4096"])
    nodes = [replace(g, count=8) for g in cfg.cluster.nodes]
    cfg = replace(cfg, cluster=replace(cfg.cluster, nodes=nodes))
    inputs = plan_inputs(cfg, None, None)
    inputs.tables = [
        replace(t, lookups_per_sample=float(h))
        for t, h in zip(inputs.tables, MLPERF_HOTNESS, strict=True)
    ]
    plan = evaluate(hybrid(inputs), inputs)
    alone = evaluate(hybrid(inputs, HybridOptions(pooled_hot=False)), inputs)
    assert plan.feasible and plan.est_step_ms < 0.95 * alone.est_step_ms
    widest = next(t for t in plan.tables if t.name == "t_cat_20")  # 100 ids a bag
    assert 0 < widest.replicated_rows < widest.rows
    assert not any(s.sparse_exchange for s in widest.shards)


def test_one_gpu_with_less_memory_than_the_tables_caches_every_large_table(
    typed_cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLPerf's 97 GiB of tables on one A100-80G with ample host memory: the pieces placed
    last found the device full and went to host memory uncached. Sharing the device's
    memory anew among every piece on the rank (`Placer.share_caches`) caches each 40M-row
    table (TorchRec's way) and keeps the small ones whole; the step comes within 0.1% of the
    bound (measured: 32.886 ms against 33.006 without it, bound 32.881)."""
    from recsys.app.planning import plan_inputs
    from sharding.placer import Placer

    cfg = typed_cfg(["cluster=1x1_a100_80g", "model=dcnv2_mlperf", "trainer.batch_size=2048"])
    inputs = plan_inputs(cfg, None, None)
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert plan.feasible and plan.est_step_ms <= 1.001 * plan.lower_bound_ms
    for t in plan.tables:
        assert t.tier == (Tier.cached if t.rows == 40_000_000 else Tier.hbm), t.name
    assert min(s.hit_rate for t in plan.tables for s in t.shards) > 0.97
    monkeypatch.setattr(Placer, "share_caches", lambda self: None)
    first_come = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert any(t.tier == Tier.host for t in first_come.tables)
    assert plan.est_step_ms < first_come.est_step_ms


def test_one_gpu_keeps_device_memory_for_the_buffers_of_pieces_still_to_come(typed_cfg) -> None:
    """MLPerf's multi-hot bags on one A100-80G: placed longest first into device memory to
    the brim, the pieces left for host memory found no room for their input and output
    buffers, and hybrid found no plan where TorchRec's planner did. Each whole piece leaves
    its rank's share of the buffers still to come."""
    from recsys.app.planning import plan_inputs
    from recsys.data.multi_hot import MLPERF_HOTNESS

    cfg = typed_cfg(["cluster=1x1_a100_80g", "model=dcnv2_mlperf", "trainer.batch_size=2048"])
    inputs = plan_inputs(cfg, None, None)
    inputs.tables = [
        replace(t, lookups_per_sample=float(h))
        for t, h in zip(inputs.tables, MLPERF_HOTNESS, strict=True)
    ]
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert plan.feasible and plan.est_step_ms <= 1.005 * plan.lower_bound_ms


# memory binds: small devices, little host memory, tables up to several GiB, narrow ones too
tight_clusters = st.builds(
    lambda groups, host: ClusterSpec(
        network=NET,
        name="tight",
        nodes=[
            NodeGroup(count=c, host_memory_gib=host, devices=[DeviceGroup(k, n, hbm_gib=m)])
            for c, k, n, m in groups
        ],
    ),
    st.lists(
        st.tuples(
            st.integers(1, 2), st.sampled_from(KINDS), st.integers(1, 4), st.floats(0.01, 1.0)
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from([0.001, 0.05, 1.0, 8.0]),
)


tight_tables = st.lists(
    st.tuples(st.integers(1, 30_000_000), st.sampled_from([4, 8, 16, 64, 128])),
    min_size=1,
    max_size=12,
).map(lambda ts: [TableStats(f"t{i}", r, d) for i, (r, d) in enumerate(ts)])


def _feasible(name: str, inputs: PlanInputs) -> bool:
    try:
        return evaluate(PLANNERS[name](inputs), inputs).feasible
    except PlanDoesNotFitError:
        return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=tight_clusters, tables=tight_tables, cpu=st.booleans())
def test_hybrid_finds_a_plan_wherever_a_simple_baseline_does(spec, tables, cpu) -> None:
    """Where greedy_size or round_robin fit the tables, hybrid does too: it cuts pieces by
    memory as well as by cost (columns, row parts, host memory with an HBM cache)."""
    inputs = inputs_for(spec, tables)
    inputs.cpu = cpu  # CPU ranks: one memory tier, no host tier to fall back on
    if not any(_feasible(name, inputs) for name in ("greedy_size", "round_robin")):
        return
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert plan.feasible


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=tight_clusters, tables=tight_tables)
def test_hybrid_finds_a_plan_wherever_torchrec_does(spec, tables) -> None:
    from sharding.torchrec_planner import torchrec_plans

    inputs = inputs_for(spec, tables)
    try:
        torchrec = torchrec_plans(inputs, PlannerConfig()).chosen
    except PlanDoesNotFitError:
        return
    if torchrec.feasible:
        assert evaluate(PLANNERS["hybrid"](inputs), inputs).feasible


def test_a_candidate_placement_that_finds_no_room_is_skipped_not_the_end(typed_cfg) -> None:
    """A grid cell (random suite 1 on generated layout 1007: a T4 beside a V100-32G, both
    with short HBM, 106 tables): some of hybrid's candidate placements fit and some do not
    (which pieces a rank can hold depends on its batch share and the order pieces come);
    the first that did not ended planning with no plan, where TorchRec had one. A
    candidate (batch split, variant, search trial) that finds no room is now skipped."""
    from benchmarks.planner_grid import workload_for
    from recsys.app.planning import plan_inputs
    from sharding.layouts import random_layout
    from sharding.suites import SuiteSpec, random_suite

    cfg = typed_cfg(["model=dcnv2_mlperf", "trainer.batch_size=2048", "trainer.precision=bf16"])
    cfg.cluster = random_layout(1007)
    inputs = workload_for(plan_inputs(cfg, None, None), random_suite(1, SuiteSpec()))
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert plan.feasible and plan.est_step_ms < 298.6  # TorchRec's best in that cell


def test_pieces_host_memory_holds_keep_device_room_for_their_buffers(typed_cfg) -> None:
    """A grid cell (random suite 21 on generated layout 1008: two L4s and a T4, 365 tables,
    52 GiB against 48 GiB of HBM, ample host): every piece in host memory still needs its
    input and output buffers in device memory. Filled to its even share of the buffers
    still to come, one rank's room ran out first and hybrid cut the pieces smaller (more
    buffers) until it gave up, where TorchRec had a 1,208 ms plan. It now keeps more room
    for buffers (and less for hot rows) and plans."""
    from benchmarks.planner_grid import workload_for
    from recsys.app.planning import plan_inputs
    from sharding.layouts import random_layout
    from sharding.suites import SuiteSpec, random_suite

    cfg = typed_cfg(["model=dcnv2_mlperf", "trainer.batch_size=2048", "trainer.precision=bf16"])
    cfg.cluster = random_layout(1008)
    inputs = workload_for(plan_inputs(cfg, None, None), random_suite(21, SuiteSpec()))
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    assert plan.feasible and plan.est_step_ms < 1207.6  # TorchRec's best in that cell
    assert any(s.tier != Tier.hbm for t in plan.tables for s in t.shards)


def test_column_pieces_partly_cached_emit_the_smallest_cache_not_none() -> None:
    """A table's column pieces share one TorchRec kernel: one piece behind a cache of half
    its rows and one whole in HBM emit UVM caching at load factor 0.5 (a piece in HBM
    counted as cached whole, where it read as an empty cache)."""
    from sharding.plan_eval import finish_table

    half = [
        Shard("t0", 0, 1000, 8, Tier.cached, hit_rate=0.9, cache_rows=500),
        Shard("t0", 1, 1000, 8),
    ]
    table = finish_table(TablePlan("t0", 1000, 16, "", [], Tier.cached, 0, 0, shards=half))
    plan = Plan("hybrid", "two", [table], [64, 64])
    ps = to_torchrec_plan(plan, {"t0": "f0"}, "cuda").plan[
        "model.sparse_arch.embedding_bag_collection"
    ]
    assert ps["t0"].compute_kernel == "fused_uvm_caching"
    assert ps["t0"].cache_params.load_factor == pytest.approx(0.5)


def test_a_table_larger_than_any_device_is_cut_in_row_parts_when_columns_run_out() -> None:
    """4-wide rows cannot be cut by columns: the table goes in row parts, each its own
    table on a rank with room, and the TorchRec plan places each part table-wise."""
    node = NodeGroup(host_memory_gib=0.001, devices=[DeviceGroup("t4_16g", 4, hbm_gib=0.05)])
    spec = ClusterSpec(network=NET, name="small", nodes=[node])
    inputs = inputs_for(spec, [TableStats("wide", 4_000_000, 4), TableStats("t1", 1000, 4)])
    inputs.cpu = True
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    wide = plan.tables[0]
    assert plan.feasible and wide.replicated_rows == 0 and wide.cold_parts >= 2
    assert [s.rows for s in wide.shards] == cold_part_rows(4_000_000, wide.cold_parts)
    sharded = to_torchrec_plan(plan, {"wide": "f0", "t1": "f1"}, "cpu").plan
    params = sharded["model.sparse_arch.embedding_bag_collection"]
    assert [params[f"wide_cold{j}"].ranks for j in range(wide.cold_parts)] == [
        [s.rank for s in wide.shards[j : j + 1]] for j in range(wide.cold_parts)
    ]


def test_large_pooled_tables_can_go_table_row_wise_over_a_node() -> None:
    """Hybrid's table-row-wise candidate: a table's rows in TorchRec's even blocks over all
    ranks of one node, emitted as TorchRec's own table_row_wise sharding."""
    from sharding.hybrid import HybridOptions, _hybrid

    spec = ClusterSpec(
        network=NET,
        name="two_nodes",
        nodes=[NodeGroup(count=2, devices=[DeviceGroup("a100_80g", 4)])],
    )
    tables = [TableStats(f"t{i}", 1_000_003, 64, 40.0) for i in range(3)]  # ids outweigh vectors
    inputs = inputs_for(spec, tables)
    plan = evaluate(
        _hybrid(inputs, [1024] * 8, HybridOptions(True, False, False), groups=True), inputs
    )
    twrw = [t for t in plan.tables if t.sharding_type == "table_row_wise"]
    assert twrw and plan.feasible
    t = twrw[0]
    ranks = sorted(s.rank for s in t.shards)
    assert ranks in ([0, 1, 2, 3], [4, 5, 6, 7])  # every rank of one node
    assert [s.rows for s in sorted(t.shards, key=lambda s: s.rank)] == [250_001] * 3 + [250_000]
    sharded = to_torchrec_plan(plan, {n.name: f"f{i}" for i, n in enumerate(tables)}, "cuda")
    ps = sharded.plan["model.sparse_arch.embedding_bag_collection"][t.name]
    assert ps.sharding_type == "table_row_wise" and sorted(ps.ranks) == ranks
    assert ps.compute_kernel == "fused"


def _mixed_tables(seed: int, n: int) -> list[TableStats]:
    gen = np.random.default_rng(seed)
    return [
        TableStats(
            f"t{i}",
            int(np.exp(gen.uniform(np.log(1e4), np.log(3e7)))),
            int(gen.choice([16, 32, 64, 128])),
            float(np.exp(gen.uniform(0, 4.6))),
        )
        for i in range(n)
    ]


def test_whole_tables_go_table_row_wise_where_that_ends_the_step_sooner() -> None:
    """EACH_GROUP: beside the tables whose column pieces' ids outweigh a vector, every other
    whole pooled table is offered as a group and placed as one where that ends the step
    sooner than on one rank (it spreads a node's sending over its ranks). On 30 mixed
    tables over two nodes of 4: some go that way, some stay whole on a rank, and the
    predicted step beats both other candidates (measured: 9.21 ms against 9.54 and 11.45)."""
    from collections import Counter

    from sharding.hybrid import EACH_GROUP, NO_GROUPS, WORTH_GROUPS, HybridOptions, _hybrid

    spec = ClusterSpec(
        network=NET,
        name="two_nodes",
        nodes=[NodeGroup(count=2, devices=[DeviceGroup("a100_80g", 4)])],
    )
    inputs = inputs_for(spec, _mixed_tables(2, 30), 2048)
    plans = {
        g: evaluate(
            _hybrid(inputs, [2048] * 8, HybridOptions(True, False, False), groups=g), inputs
        )
        for g in (NO_GROUPS, WORTH_GROUPS, EACH_GROUP)
    }
    kinds = {g: Counter(t.sharding_type for t in p.tables) for g, p in plans.items()}
    assert kinds[EACH_GROUP]["table_row_wise"] > kinds[WORTH_GROUPS]["table_row_wise"] > 0
    assert kinds[EACH_GROUP]["table_wise"] > 0 and kinds[NO_GROUPS]["table_row_wise"] == 0
    steps = {g: p.est_step_ms for g, p in plans.items()}
    assert steps[EACH_GROUP] < steps[WORTH_GROUPS] < steps[NO_GROUPS], steps
    assert all(p.feasible for p in plans.values())


def test_the_shape_search_finds_a_faster_plan_than_the_placement_it_starts_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_reshape`: each pooled table tried whole, in column pieces and as a table-row-wise
    group, judged by the cost model (which, unlike the placer, counts the ids every column
    piece receives). On 20 mixed tables over two nodes of 4 it cuts the predicted step
    (measured: 5.41 ms against 6.22 ms without it) and the plan still fits. The batch is
    priced ready: at this machine's calibrated batch assembly the host's floor would bound
    both steps (`host_s_per_sample`)."""
    import sharding.hybrid as hybrid_module

    spec = ClusterSpec(
        network=NET,
        name="two_nodes",
        nodes=[NodeGroup(count=2, devices=[DeviceGroup("a100_80g", 4)])],
    )
    inputs = inputs_for(spec, _mixed_tables(3, 20), 2048)
    inputs.devices = [replace(d, host_s_per_sample=0.0) for d in inputs.devices]
    # one family of candidates (hot parts only before cold parts exchanged alone): the other
    # is finished too, and may win without any search
    options = hybrid_module.HybridOptions(pooled_hot=False)
    searched = evaluate(hybrid_module.hybrid(inputs, options), inputs)
    monkeypatch.setattr(hybrid_module, "RESHAPE_TRIALS", (0, 0))  # the search off
    greedy = evaluate(hybrid_module.hybrid(inputs, options), inputs)
    assert searched.feasible and searched.est_step_ms < 0.9 * greedy.est_step_ms


def test_the_placer_takes_a_table_back_exactly() -> None:
    """`Placer.take` undoes placing a table's pieces (whole, column pieces or a group):
    the ranks' loads, exchange bytes and free memory are as if it had never been placed,
    and `restore` returns to a `snapshot`."""
    from sharding.hybrid import _put
    from sharding.placer import Piece, Placer

    spec = ClusterSpec(
        network=NET,
        name="two_nodes",
        nodes=[NodeGroup(count=2, devices=[DeviceGroup("a100_80g", 4)])],
    )
    tables = _mixed_tables(1, 4)
    inputs = inputs_for(spec, tables, 2048)
    pieces = [Piece(t, t.rows, t.dim, 1.0, False) for t in tables]

    def state(placer: Placer) -> list[np.ndarray]:
        return [
            placer.free_hbm,
            placer.load,
            placer.sent_intra,
            placer.sent_inter,
            placer.recv_intra,
            placer.recv_inter,
        ]

    for shape in ("group", 1, 4):
        without = Placer(inputs, [2048] * 8, speed_aware=True)
        placer = Placer(inputs, [2048] * 8, speed_aware=True)
        for p in (without, placer):
            p.expect(pieces)
            for q in pieces[:3]:
                assert _put(p, q, 2, inputs)
        before = placer.snapshot()
        assert _put(placer, pieces[3], shape, inputs)
        assert any(q.table.name == "t3" for q, _ in placer.placed)
        after = [a.copy() for a in state(placer)]
        placer.take("t3")
        assert [q.table.name for q, _ in placer.placed] == [q.table.name for q, _ in without.placed]
        for a, b in zip(state(placer), state(without), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-6)
        placer.restore(before)
        assert _put(placer, pieces[3], shape, inputs)
        for a, b in zip(state(placer), after, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-6)


def test_a_group_that_finds_no_node_falls_back_to_its_memory_sized_pieces() -> None:
    """Found by the TorchRec property test: a 4-wide table too large for any device was
    offered as a table-row-wise group, and when no node held the group it was placed whole
    (and failed); it must fall back to pieces its size asks for: row parts, or the group
    where a node holds it."""
    node = NodeGroup(host_memory_gib=0.001, devices=[DeviceGroup("h100_80g", 3, hbm_gib=0.4288)])
    spec = ClusterSpec(network=NET, name="tight", nodes=[node])
    sizes = [(2408, 64), (387470, 64), (3463769, 16), (21253109, 4)]
    inputs = inputs_for(spec, [TableStats(f"t{i}", r, d) for i, (r, d) in enumerate(sizes)])
    plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
    t3 = plan.tables[3]
    assert plan.feasible and (t3.cold_parts >= 2 or t3.sharding_type == "table_row_wise")


def test_the_placer_puts_each_piece_where_the_step_ends_soonest() -> None:
    """`Placer._best` computes, for every rank at once, the step's slowest lookups plus its
    slowest exchange with the piece placed there (the cost model's sum of stage maxima);
    checked against placing the piece on each rank in turn and asking `score`, on a mixed
    cluster of two nodes with unequal batches and several pieces already placed."""
    from sharding.placer import Piece, Placer

    spec = ClusterSpec(
        network=NET,
        name="mixed",
        nodes=[
            NodeGroup(devices=[DeviceGroup("h100_80g", 3)]),
            NodeGroup(devices=[DeviceGroup("a100_80g", 2), DeviceGroup("t4_16g", 2)]),
        ],
    )
    gen = np.random.default_rng(0)
    tables = [
        TableStats(
            f"t{i}",
            int(gen.integers(1e3, 1e6)),
            int(gen.choice([16, 64, 128])),
            float(gen.uniform(1, 40)),
        )
        for i in range(24)
    ]
    inputs = inputs_for(spec, tables)
    placer = Placer(inputs, [2048, 2048, 2048, 1024, 1024, 512, 512], speed_aware=True)
    pieces = [Piece(t, t.rows, t.dim, 1.0, sparse_exchange=False) for t in tables]
    placer.expect(pieces)
    for p in pieces:
        lookup_s = p.looked_up_bytes(placer.total) * placer.per_byte
        scores = []
        for r in range(inputs.world):  # brute force: place it there, score, take it back
            placer._commit(r, p, lookup_s[r])
            scores.append(placer.score()[0])
            placer._commit(r, p, lookup_s[r], sign=-1.0)
        chosen, score = placer._best(p, lookup_s, np.ones(inputs.world, dtype=bool))
        assert scores[chosen] == pytest.approx(min(scores), rel=1e-12) == score
        placer._commit(chosen, p, lookup_s[chosen])
    look, exch = placer.load - placer.dense, placer.exchange()
    assert placer.score()[0] == pytest.approx(look.max() + exch.max())


def test_near_copies_of_a_placed_batch_split_are_not_placed_again() -> None:
    """The ranking prices every split on the speed split's placement, so its near copies
    rank first; within 2% of the global batch on every rank, a split is a copy of the
    speed split or of one kept before it, and a different split is placed instead."""
    from sharding.hybrid import distinct_batches

    speed = [3796, 1174, 1174]
    ranked = [
        [3805, 1170, 1169],
        [3800, 1172, 1172],
        [4968, 588, 588],
        [4960, 592, 592],
        [6141, 2, 1],
    ]
    assert distinct_batches(ranked, speed) == [[4968, 588, 588], [6141, 2, 1]]
    assert distinct_batches(ranked) == [[3805, 1170, 1169], [4968, 588, 588], [6141, 2, 1]]


def test_the_bounds_lookups_take_the_all_reduce_as_each_schedule_overlaps_it() -> None:
    """Outside nested micro-batches the all-reduce crosses under the lookups' backward, so
    the bound adds the forward pass and the longer of the backward and the all-reduce, each
    spread over the cluster; under nested it crosses under both passes (the update and the
    next lookups), so the bound takes the longer of all the lookups and the all-reduce."""
    from sharding.bound import lookups_and_reduce_s, lookups_spread_s

    spec = ClusterSpec(
        name="mix",
        network=NET,
        nodes=[NodeGroup(devices=[DeviceGroup("a100_40g", 1), DeviceGroup("t4_16g", 1)])],
    )
    inputs = inputs_for(spec, [TableStats(f"t{i}", 100_000, 128) for i in range(8)])
    both = lookups_spread_s(inputs)  # both passes spread together
    apart = lookups_and_reduce_s(inputs, 0.0)  # each pass spread alone: no slower
    assert 0 < apart <= both * (1 + 1e-12)
    long = 10 * both  # an all-reduce longer than every lookup takes the backward's place
    forward = lookups_and_reduce_s(inputs, long) - long
    assert 0 < forward < apart
    nested = replace(inputs, schedule=Schedule.nested, micro_batches=4)
    assert lookups_and_reduce_s(nested, long) == pytest.approx(long)
    assert lookups_and_reduce_s(nested, 0.0) == pytest.approx(both)
