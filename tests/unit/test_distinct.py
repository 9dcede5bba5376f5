"""What dedup sends: distinct ids from a coverage curve or a measured profile, per rank."""

from __future__ import annotations

import numpy as np
import pytest

from recsys.data.planted import power_law_ranks
from sharding.access_profile import build_profile
from sharding.distinct import dedup_volume, expected_distinct, with_dedup
from sharding.types import (
    ALL_RANKS,
    Plan,
    PlanInputs,
    PowerLawCoverage,
    Shard,
    StepCost,
    TablePlan,
    TableStats,
)


@pytest.mark.parametrize(
    "rows,exponent,draws", [(10_000, 1.1, 2_000), (1_000_000, 0.8, 8_192), (500, 1.3, 20_000)]
)
def test_expected_distinct_matches_sampled_power_law_draws(rows, exponent, draws) -> None:
    rng = np.random.default_rng(1)
    sampled = np.mean(
        [len(np.unique(power_law_ranks(rng.random(draws), rows, exponent))) for _ in range(20)]
    )
    expected = expected_distinct(PowerLawCoverage(rows, exponent), rows, draws)
    assert expected == pytest.approx(sampled, rel=0.03)
    assert expected <= min(rows, draws)


def _inputs(tables: list[TableStats], batch: list[int]) -> PlanInputs:
    """What dedup_volume reads: the tables and their coverage curves."""
    return PlanInputs(
        tables=tables,
        ranks=[],
        devices=[],
        network=None,  # type: ignore[arg-type]
        coverage={t.name: PowerLawCoverage(t.rows, 1.1) for t in tables},
        global_batch=sum(batch),
        dense_params=0,
    )


def _plan(shards: list[Shard], tables: list[TableStats], batch: list[int]) -> Plan:
    by = {t.name: t for t in tables}
    plans = [
        TablePlan(
            n,
            by[n].rows,
            by[n].dim,
            "table_wise",
            [],
            None,
            0,
            0,  # type: ignore[arg-type]
            [s for s in shards if s.table == n],
        )
        for n in by
    ]
    return Plan("test", "test", plans, batch)


def test_dedup_volume_weights_tables_by_bytes_and_skips_what_the_pipeline_does_not_dedup() -> None:
    tables = [
        TableStats("a", 10, 16, 4.0),
        TableStats("b", 1_000_000, 16, 1.0),
        TableStats("c", 100, 16, 1.0),
    ]
    batch = [256, 256]
    profile = build_profile(
        [(4, {"a": np.arange(4), "b": np.arange(4), "c": np.arange(4)})],
        {"a": 10, "b": 1_000_000, "c": 100},
    )
    profile.table("a").distinct_per_samples = {"64": 10.0, "128": 10.0}  # every row, 256 ids
    profile.table("b").distinct_per_samples = {"64": 64.0, "128": 128.0}  # no repeats
    shards = [
        Shard("a", 0, 10, 16),
        Shard("b", 1, 1_000_000, 16),
        Shard("c", ALL_RANKS, 100, 16, dp=True),
    ]
    inputs = _inputs(tables, batch)
    v = dedup_volume(_plan(shards, tables, batch), inputs, 2, profile)
    # micro-batches of 128 samples: a sends 10 rows for 128 vectors, b 128 for 128
    assert v.vectors == pytest.approx([(10 + 128) / 256] * 2)
    assert v.ids == pytest.approx([(10 + 128) / (4 * 128 + 128)] * 2)
    assert v.source == "measured"
    # a table-row-wise group is not deduplicated: its volume stays
    grouped = [Shard("a", 0, 10, 16, node_reduce=True), Shard("b", 1, 1_000_000, 16)]
    g = dedup_volume(_plan(grouped, tables, batch), inputs, 2, profile)
    assert g.vectors == pytest.approx([(128 + 128) / 256] * 2)
    with pytest.raises(ValueError, match="clustering"):
        dedup_volume(_plan(shards, tables, batch), inputs, 2, profile, clustered=True)
    curve = dedup_volume(_plan(shards, tables, batch), inputs, 2, None)
    assert curve.source == "coverage curve" and curve.vectors[0] < 1.0


def test_with_dedup_scales_only_the_exchange() -> None:
    cost = StepCost(
        [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [4.0, 4.0], [4.0, 4.0], [3.0, 3.0], 0.5, 0.1
    )
    from sharding.distinct import DedupVolume

    volume = DedupVolume([0.5, 1.0], [0.25, 2.0], "measured")
    out = with_dedup(cost, volume)
    assert out.ids_a2a_s == [1.0, 2.0]
    assert out.emb_a2a_fwd_s == [1.0, 8.0] and out.emb_a2a_bwd_s == [1.0, 8.0]
    assert out.dense_s == cost.dense_s and out.allreduce_s == cost.allreduce_s
    # forward only: every id routed, the gradients pooled
    fwd = with_dedup(cost, volume, grads=False)
    assert fwd.ids_a2a_s == cost.ids_a2a_s and fwd.emb_a2a_bwd_s == cost.emb_a2a_bwd_s
    assert fwd.emb_a2a_fwd_s == [1.0, 8.0]
