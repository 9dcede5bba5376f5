"""The nested pipeline's pieces in one process: micro-batch sizes, whole bags moved by a
permutation, samples clustered by key, the ids each micro-batch routes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.clustering import cluster_order, distinct_ids_per_micro_batch, permute_kjt
from pipelines.exchange import ChunkPlan, micro_sizes


def _kjt(rows: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    keys = list(rows)
    lengths = [len(bag) for k in keys for bag in rows[k]]
    values = [i for k in keys for bag in rows[k] for i in bag]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )


def test_micro_sizes_cover_the_batch() -> None:
    assert micro_sizes(10, 4) == [3, 3, 2, 2]
    assert micro_sizes(3, 4) == [1, 1, 1, 0]
    plan = ChunkPlan([5, 3], 2)
    assert plan.rows(0, 1) == slice(3, 5) and plan.rows(1, 0) == slice(5, 7)
    assert plan.rows(1, 1) == slice(7, 8)


def test_permute_kjt_moves_whole_bags() -> None:
    kjt = _kjt({"a": [[1], [2, 3], [], [4]], "b": [[5, 6], [7], [8], []]})
    out = permute_kjt(kjt, torch.tensor([2, 0, 3, 1]))
    assert [t.tolist() for t in out["a"].to_dense()] == [[], [1], [4], [2, 3]]
    assert [t.tolist() for t in out["b"].to_dense()] == [[8], [5, 6], [], [7]]


def test_cluster_order_groups_shared_ids_and_permutes() -> None:
    """Samples of the same user share ids across features (as in real click logs): the
    order puts them together and each micro-batch holds fewer distinct ids."""
    gen = np.random.default_rng(0)
    batch, n, users = 512, 4, 40
    user = gen.integers(0, users, batch)
    profile = gen.integers(0, 1000, (users, 6))  # each user's id in each feature
    noise = gen.random((batch, 6)) < 0.2  # a fifth of the ids are the user's own
    ids = np.where(noise, gen.integers(0, 1000, (batch, 6)), profile[user])
    kjt = _kjt({f"f{i}": [[int(x)] for x in ids[:, i]] for i in range(6)})
    order = cluster_order(kjt, n)
    assert sorted(order.tolist()) == list(range(batch))
    before = sum(distinct_ids_per_micro_batch(kjt, n))
    after = sum(distinct_ids_per_micro_batch(permute_kjt(kjt, order), n))
    assert after < 0.7 * before, (before, after)


def test_routed_ids_are_each_micro_batchs_distinct_ids_in_its_first_bag() -> None:
    from pipelines.dedup import route_distinct

    kjt = _kjt({"a": [[5, 5], [3], [5], [], [7, 7]], "b": [[1], [2], [3], [4], [5]]})
    # micro-batches of 3 and 2 samples: their first samples 0 and 3; a holds 6 ids, b 5
    distinct = {"a": [torch.tensor([3, 5]), torch.tensor([7])]}
    out = route_distinct(kjt, distinct, [0, 3], [6, 5])
    assert [t.tolist() for t in out["a"].to_dense()] == [[3, 5], [], [], [7], []]
    assert torch.equal(out["b"].values(), kjt["b"].values())  # other features as they were
    clustered = route_distinct(kjt, distinct, [2, 4], [6, 5])  # samples [2, 0, 1] and [4, 3]
    assert [t.tolist() for t in clustered["a"].to_dense()] == [[], [], [3, 5], [], [7]]
    empty_first = route_distinct(
        kjt, {"a": [torch.tensor([], dtype=torch.int64), torch.tensor([7])]}, [None, 3], [6, 5]
    )
    assert [t.tolist() for t in empty_first["a"].to_dense()] == [[], [], [], [7], []]


def test_cluster_order_leaves_single_micro_batch_alone() -> None:
    kjt = _kjt({"a": [[3], [1], [2]]})
    assert cluster_order(kjt, 1).tolist() == [0, 1, 2]


def test_unsupported_sharding_is_named() -> None:
    from pipelines.lookups import _group_exchange

    module = SimpleNamespace(_output_dists=[torch.nn.Identity()], _sharding_types=["grid_shard"])
    with pytest.raises(NotImplementedError, match="grid_shard.*pipeline=sparse_dist"):
        _group_exchange(module, 0, "model.sparse_arch.ebc")


def test_a_plan_the_nested_pipeline_cannot_run_is_named_before_sharding() -> None:
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    from pipelines.build import unsupported_sharding
    from pipelines.types import PipelineConfig, PipelineName

    def plan(sharding_type: str) -> ShardingPlan:
        ps = ParameterSharding(sharding_type=sharding_type, compute_kernel="fused", ranks=[0, 1])
        return ShardingPlan({"model.sparse_arch.ebc": {"t_cat_0": ps}})

    nested = PipelineConfig(name=PipelineName.nested)
    why = unsupported_sharding(nested, plan("grid_shard"))
    assert why and "'t_cat_0'" in why and "grid_shard" in why and "pipeline=sparse_dist" in why
    for kind in (
        "table_wise",
        "column_wise",
        "table_column_wise",
        "row_wise",
        "table_row_wise",
        "data_parallel",
    ):
        assert unsupported_sharding(nested, plan(kind)) is None
    sparse_dist = PipelineConfig(name=PipelineName.sparse_dist)
    assert unsupported_sharding(sparse_dist, plan("grid_shard")) is None  # it runs any plan
    dedup = PipelineConfig(name=PipelineName.nested, dedup=True)  # row-wise owners send sums
    for kind in ("row_wise", "table_row_wise"):
        assert "pipeline.dedup=false" in unsupported_sharding(dedup, plan(kind))
    assert unsupported_sharding(dedup, plan("table_wise")) is None
    cached = plan("table_wise")
    cached.plan["model.sparse_arch.ebc"]["t_cat_0"].compute_kernel = "fused_uvm_caching"
    assert unsupported_sharding(nested, cached) is None
    ahead = PipelineConfig(name=PipelineName.nested, lookahead=True)
    assert "pipeline.lookahead=false" in unsupported_sharding(ahead, cached)
    assert unsupported_sharding(ahead, plan("table_wise")) is None


def test_a_sequence_module_sharded_other_than_table_wise_is_named() -> None:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    from pipelines.lookups import _group_exchange

    module = ShardedEmbeddingCollection.__new__(ShardedEmbeddingCollection)
    module._sharding_type_to_sharding = {"row_wise": None}
    module._output_dists = [None]
    with pytest.raises(NotImplementedError, match="'m.ec'.*row_wise.*cold_only_exchange=false"):
        _group_exchange(module, 0, "m.ec")
