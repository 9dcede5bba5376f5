"""Model shapes: the configs build, and bad shapes fail naming the field."""

from __future__ import annotations

import pytest
import torch

from recsys.config import Arch, ModelConfig, ModelConfigError
from recsys.models.dlrm import build_model, table_configs


def test_mlperf_reference_shapes(typed_cfg) -> None:
    cfg = typed_cfg(["model=dcnv2_mlperf"]).model
    assert cfg.arch == Arch.dcnv2 and cfg.embedding_dim == 128
    assert list(cfg.dense_arch_layer_sizes) == [512, 256, 128]
    assert list(cfg.over_arch_layer_sizes) == [1024, 1024, 512, 256, 1]
    assert (cfg.dcn_num_layers, cfg.dcn_low_rank_dim) == (3, 512)
    assert len(cfg.num_embeddings_per_feature) == 26
    assert max(cfg.num_embeddings_per_feature) == 40_000_000
    model = build_model(cfg, dense_device=torch.device("meta"))  # ~97 GiB: meta only
    rows = sum(t.num_embeddings for t in table_configs(cfg))
    assert rows == sum(cfg.num_embeddings_per_feature)
    cross = model.model.inter_arch.crossnet
    assert len(cross.V_kernels) == 3  # (rank, (26 tables + dense) x 128) low-rank factors
    assert tuple(cross.V_kernels[0].shape) == (512, 27 * 128)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"over_arch_layer_sizes": [64, 2]}, "over_arch_layer_sizes"),
        ({"dense_arch_layer_sizes": [64, 8]}, "dense_arch_layer_sizes"),
        ({"num_embeddings_per_feature": [10, 0]}, "num_embeddings_per_feature"),
        ({"embedding_dim": 0, "dense_arch_layer_sizes": [0]}, "embedding_dim"),
    ],
)
def test_bad_shapes_fail_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        build_model(ModelConfig(**change), dense_device=torch.device("cpu"))


def test_replicated_tables_get_the_row_wise_adagrad_of_the_fused_ones() -> None:
    from recsys.config import SparseOptimizer, TrainerConfig
    from recsys.trainer.build import _replicated_embedding_optimizer

    w = torch.nn.Parameter(torch.ones(4, 3))
    opt = _replicated_embedding_optimizer(TrainerConfig(embedding_lr=0.1, eps=1e-8), {"w": w})
    w.grad = torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 4.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    opt.step()
    # row-wise Adagrad: one accumulator per row, mean(g^2); untouched rows do not move
    assert torch.equal(w.data[0], torch.ones(3)) and torch.equal(w.data[2], torch.ones(3))
    rms = (torch.tensor(25.0 / 3)).sqrt()
    assert torch.allclose(w.data[1], 1 - 0.1 * torch.tensor([3.0, 0.0, 4.0]) / rms)
    assert torch.allclose(w.data[3], torch.full((3,), 1 - 0.1))
    sgd = _replicated_embedding_optimizer(
        TrainerConfig(embedding_lr=0.5, sparse_optimizer=SparseOptimizer.sgd), {"w": w}
    )
    before = w.data.clone()
    sgd.step()
    assert torch.allclose(w.data, before - 0.5 * w.grad)


def test_replicated_fp16_rows_update_as_fbgemm_does() -> None:
    """Replicated tables' row-wise Adagrad: on fp32 rows TorchRec's own arithmetic, bit for
    bit; on fp16 rows the same update computed in fp32 and rounded (TorchRec's computes in
    fp16, where eps is 0 and an untouched row's update is 0 / 0)."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recsys.trainer.build import ReplicatedRowWiseAdagrad

    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(6, 4, generator=gen)
    grads = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    for g in grads:
        g[2] = 0.0  # a row no sample touched
    runs = {}
    for name, cls, dtype in (
        ("torchrec", RowWiseAdagrad, torch.float32),
        ("ours", ReplicatedRowWiseAdagrad, torch.float32),
        ("ours16", ReplicatedRowWiseAdagrad, torch.float16),
        ("torchrec16", RowWiseAdagrad, torch.float16),
    ):
        p = torch.nn.Parameter(weights.clone().to(dtype))
        opt = cls([p], lr=0.1, eps=1e-8)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        runs[name] = p.detach()
    assert torch.equal(runs["ours"], runs["torchrec"])
    assert runs["ours16"].dtype == torch.float16 and torch.isfinite(runs["ours16"]).all()
    assert torch.allclose(runs["ours16"].float(), runs["torchrec"], atol=2e-3)
    assert not torch.isfinite(runs["torchrec16"]).all()  # what this class exists for


ARCHS = {
    Arch.dlrm: "DLRM",
    Arch.dcnv2: "DLRM_DCN",
    Arch.projection: "DLRM_Projection",
    Arch.deepfm: "SimpleDeepFMNN",
    Arch.two_tower: "TwoTower",
}


@pytest.mark.parametrize(
    "name", ["dlrm_small", "dcnv2_small", "projection_small", "deepfm_small", "two_tower_small"]
)
def test_every_torchrec_model_trains_as_dense_sparse_to_logits(typed_cfg, name) -> None:
    """Each `model=` option: TorchRec's model inside DLRMTrain, `model(dense, sparse)`
    giving one logit a sample (DeepFM's sigmoid left to the loss); the cost model's
    inputs work it out on meta."""
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRMTrain

    from recsys.config import SyntheticConfig
    from recsys.data.synthetic import SyntheticCriteo
    from recsys.models.cost_inputs import model_cost
    from recsys.models.dlrm import build_torchrec_model

    cfg = typed_cfg([f"model={name}"]).model
    assert type(build_model(cfg, torch.device("meta")).model).__name__ == ARCHS[cfg.arch]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(table_configs(cfg))  # on CPU: the train module's are meta
    train = DLRMTrain(build_torchrec_model(cfg, ebc, torch.device("cpu")))
    names = [f"cat_{i}" for i in range(len(cfg.num_embeddings_per_feature))]
    batch = SyntheticCriteo(
        SyntheticConfig(), cfg.num_embeddings_per_feature, names, cfg.dense_in_features, 64
    ).batch("train", 0, 0)
    loss, (_, logits, _) = train(batch)
    assert logits.shape == (64,) and torch.isfinite(loss)
    assert not any(isinstance(m, torch.nn.Sigmoid) for m in train.modules())
    cost = model_cost(cfg)
    assert cost.dense_params == sum(
        p.numel() for n, p in train.named_parameters() if "embedding_bags" not in n
    )
    assert cost.activation_bytes_per_sample > 0
    assert (cost.interaction_flops_per_sample > 0) == (cfg.arch != Arch.dcnv2)


@pytest.mark.parametrize(
    "change,field",
    [
        (
            {"arch": "projection", "interaction_branch1_layer_sizes": [64, 20]},
            "interaction_branch1_layer_sizes",
        ),
        ({"arch": "deepfm"}, "over_arch_layer_sizes"),  # TorchRec's one output layer
        (
            {"arch": "deepfm", "over_arch_layer_sizes": [1], "dense_arch_layer_sizes": [16]},
            "dense_arch_layer_sizes",
        ),
        ({"arch": "two_tower", "query_features": 26}, "query_features"),  # no candidate side
        ({"arch": "two_tower", "tower_layer_sizes": []}, "tower_layer_sizes"),
    ],
)
def test_bad_shapes_of_the_other_models_fail_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        build_model(ModelConfig(**change), dense_device=torch.device("cpu"))


def test_a_split_collection_gives_deepfm_each_features_pooled_vector_by_name() -> None:
    """DeepFM's interaction indexes pooled vectors by feature: the keyed split arch gives
    the same vectors as the stacked one DLRM takes."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    from recsys.models.split import SplitSparseArch

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t_f{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    ebc = EmbeddingBagCollection(tables)
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.randint(0, 20, (12,)), lengths=torch.full((6,), 2)
    )
    names = ["f0", "f1", "f2"]
    stacked = SplitSparseArch(ebc, names)(kjt)
    keyed = SplitSparseArch(ebc, names, keyed=True)(kjt)
    assert list(keyed) == names
    for i, f in enumerate(names):
        assert torch.equal(keyed[f], stacked[:, i])
