"""The planner as a library (`sharding.api.HybridPlanner`): a TorchRec user's model planned in a
few lines, keyed by the model's own module paths, never silently left unsharded."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRMTrain

from sharding import api as sharding
from sharding.api import PlannerInputError
from sharding.cluster import ClusterConfigError, resolve_cluster
from sharding.types import PlanDoesNotFitError

META = torch.device("meta")


def _dlrm(rows=(1000, 50_000, 200, 20_000)) -> DLRM:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(rows)
    ]
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables, device=META),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 1],
        dense_device=META,
    )


@pytest.mark.parametrize("cluster", ["emu_mixed4", "hetero_3node"])
def test_a_users_model_is_planned_at_its_own_module_paths(cluster: str) -> None:
    model = _dlrm()
    plan = sharding.HybridPlanner(cluster, batch_size=2048).plan(model)
    assert list(plan.plan) == ["sparse_arch.embedding_bag_collection"]
    assert set(plan.plan["sparse_arch.embedding_bag_collection"]) == {"t0", "t1", "t2", "t3"}
    world = len(resolve_cluster(sharding.load_cluster(cluster)))
    assert len(plan.batch_per_rank) == world and sum(plan.batch_per_rank) == 2048 * world
    assert plan.lower_bound_ms <= plan.est_step_ms * (1 + 1e-9) and plan.report.feasible
    wrapped = sharding.HybridPlanner(cluster, batch_size=2048).plan(DLRMTrain(model))
    assert list(wrapped.plan) == ["model.sparse_arch.embedding_bag_collection"]
    sharding.check_plan_paths(DLRMTrain(model), wrapped)
    with pytest.raises(PlannerInputError, match="unsharded"):
        sharding.check_plan_paths(model, wrapped)  # DMP would shard nothing
    assert "hybrid plan for" in str(plan) and "sharding type" in str(plan)


def test_a_slow_device_gets_a_smaller_share() -> None:
    plan = sharding.HybridPlanner("emu_mixed4", batch_size=2048).plan(_dlrm())
    fast, slow = plan.batch_per_rank[0], plan.batch_per_rank[3]
    assert fast > slow  # ranks 0-1 at 0.6 of a core, 2-3 at 0.25


def test_what_cannot_be_planned_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(PlannerInputError, match="no EmbeddingBagCollection"):
        sharding.HybridPlanner("local_cpu2", batch_size=64).plan(torch.nn.Linear(3, 1))
    with pytest.raises(PlanDoesNotFitError, match="Largest tables: t0"):
        sharding.HybridPlanner("local_cpu2", batch_size=64).plan(_dlrm(rows=(10**9, 10)))
    with pytest.raises(ClusterConfigError, match="no cluster file"):
        sharding.load_cluster("no_such_cluster")


def test_a_cluster_file_loads_with_or_without_hydra_defaults(tmp_path) -> None:
    text = (
        "defaults: [base_cluster, _self_]\nname: lab\nnodes:\n"
        "  - {count: 2, devices: [{kind: a100_80g, count: 4}]}\n"
        "network: {intra_node_gbit_s: 600, inter_node_gbit_s: 100}\n"
    )
    (tmp_path / "lab.yaml").write_text(text)
    spec = sharding.load_cluster(tmp_path / "lab.yaml")
    assert spec.name == "lab" and len(resolve_cluster(spec)) == 8
    (tmp_path / "bad.yaml").write_text(text.replace("count: 4", "count: 4, hbm: 80"))
    with pytest.raises(ClusterConfigError, match=r"nodes\[0\].devices\[0\].*unknown key.*hbm"):
        sharding.load_cluster(tmp_path / "bad.yaml")


def _train_plan(shares: list[int]) -> sharding.HybridShardingPlan:
    model = DLRMTrain(_dlrm())
    plan = sharding.HybridPlanner("local_cpu2", batch_size=64).plan(model)
    plan.batch_per_rank = shares
    return plan


def test_prepare_weights_each_ranks_loss_by_its_share() -> None:
    """Unequal shares: the loss becomes the rank's summed loss x world / global batch (its
    gradients averaged over ranks are then the global batch's mean); equal shares: as it
    was. The plan's paths are checked on the way."""
    logits, labels = torch.tensor([0.3, -1.2, 2.0]), torch.tensor([1.0, 0.0, 1.0])
    model = DLRMTrain(_dlrm())
    assert _train_plan([32, 32]).prepare(model) is model
    assert isinstance(model.loss_fn, torch.nn.BCEWithLogitsLoss)  # untouched
    _train_plan([48, 16]).prepare(model)
    summed = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    assert torch.equal(model.loss_fn(logits, labels), summed * (2 / 64))
    assert model.loss_reduction == "sum"
    with pytest.raises(PlannerInputError, match="unsharded"):
        _train_plan([48, 16]).prepare(_dlrm())  # the bare DLRM: the paths do not match


def test_prepare_refuses_a_loss_it_cannot_rescale() -> None:
    class WorstSample(torch.nn.Module):  # couples the samples: no sum to rescale
        def forward(self, logits, labels):
            return (logits - labels).abs().max()

    model = DLRMTrain(_dlrm())
    model.loss_fn = WorstSample()
    with pytest.raises(PlannerInputError, match=r"unequal batches \[48, 16\].*is WorstSample"):
        _train_plan([48, 16]).prepare(model)
    model.loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")  # not a mean either
    with pytest.raises(PlannerInputError, match="is BCEWithLogitsLoss, not a torch loss"):
        _train_plan([48, 16]).prepare(model)
