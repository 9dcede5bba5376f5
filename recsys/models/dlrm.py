"""TorchRec's models (`torchrec.models`: DLRM, DLRM_DCN, DLRM_Projection, SimpleDeepFMNN;
and a two-tower model, `recsys.models.two_tower`) built from a `recsys.config.ModelConfig`,
each as `model(dense, sparse) -> logits` inside TorchRec's `DLRMTrain` (BCE with logits):
the contract every pipeline trains (docs/training.md, "Models").

The embedding tables are one EmbeddingBagCollection, one table per categorical feature
(`t_cat_<i>` serves feature `cat_<i>`: TorchRec's Criteo names, `cat_0` .. `cat_25`, and on
for data sets with more features).
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from torchrec.modules.embedding_configs import DataType

from recsys.config import Arch, ModelConfig, TableDtype, validate_model_config

DATA_TYPES = {TableDtype.fp32: DataType.FP32, TableDtype.fp16: DataType.FP16}


def feature_names(cfg: ModelConfig) -> list[str]:
    return [f"cat_{i}" for i in range(len(cfg.num_embeddings_per_feature))]


def table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[name],
            data_type=DATA_TYPES[TableDtype(cfg.table_dtype)],
        )
        for name, rows in zip(feature_names(cfg), cfg.num_embeddings_per_feature, strict=True)
    ]


def build_model(
    cfg: ModelConfig,
    dense_device: torch.device,
    hot_rows: dict[str, int] | None = None,
    sequence_cold: frozenset[str] = frozenset(),
    cold_parts: dict[str, int] | None = None,
) -> DLRMTrain:
    """The train module (model + BCE loss). Tables are on meta: DMP materialises its shards.

    `hot_rows`: tables split into `<name>_hot` / `<name>_cold` (see `recsys.models.split`),
    `cold_parts`: cold parts (or whole tables without hot rows) in row parts
    `<name>_cold0`...; the batches must then go through the matching `SplitRemap`.
    `sequence_cold`: the split tables whose cold parts are sequence tables (they exchange
    only their own lookups), the others' stay pooled bags.
    """
    validate_model_config(cfg)
    ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("meta"))
    model = build_torchrec_model(cfg, ebc, dense_device)
    hot_rows, cold_parts = hot_rows or {}, cold_parts or {}
    from recsys.models.split import is_split

    splits = [
        t.name
        for t in table_configs(cfg)
        if is_split(t.num_embeddings, hot_rows.get(t.name, 0), cold_parts.get(t.name, 1))
    ]
    if splits:
        from torchrec import EmbeddingCollection

        from recsys.models.split import SplitSparseArch, sequence_cold_configs, split_configs

        meta = torch.device("meta")
        split = split_configs(table_configs(cfg), hot_rows, cold_parts)
        ec = None
        if sequence_cold:  # cold parts of hot/cold splits exchange only their own lookups
            split, cold = sequence_cold_configs(split, sequence_cold)
            ec = EmbeddingCollection(tables=cold, device=meta) if cold else None
        split_ebc = EmbeddingBagCollection(tables=split, device=meta)
        keyed = Arch(cfg.arch) == Arch.deepfm  # its interaction takes pooled vectors by name
        model.sparse_arch = SplitSparseArch(split_ebc, feature_names(cfg), ec, keyed)
    return DLRMTrain(model)


def build_torchrec_model(
    cfg: ModelConfig, ebc: EmbeddingBagCollection, dense_device: torch.device
) -> torch.nn.Module:
    """The model `cfg.arch` names over the collection `ebc`, its dense part on `dense_device`."""
    arch = Arch(cfg.arch)
    if arch == Arch.two_tower:
        from recsys.models.two_tower import TwoTower

        return TwoTower(
            ebc,
            cfg.dense_in_features,
            list(cfg.dense_arch_layer_sizes),
            cfg.query_features,
            list(cfg.tower_layer_sizes),
            dense_device,
        )
    if arch == Arch.deepfm:
        with dense_device:
            model = SimpleDeepFMNN(
                cfg.dense_in_features, ebc, cfg.dense_arch_layer_sizes[0], cfg.deep_fm_dimension
            )
        # TorchRec's over arch ends in a sigmoid; the train module's loss takes logits
        *layers, last = model.over_arch.model
        assert isinstance(last, torch.nn.Sigmoid), model.over_arch
        model.over_arch.model = torch.nn.Sequential(*layers)
        return model
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.dense_in_features,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
        dense_device=dense_device,
    )
    if arch == Arch.dcnv2:
        return DLRM_DCN(
            **common, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim
        )
    if arch == Arch.projection:
        return DLRM_Projection(
            **common,
            interaction_branch1_layer_sizes=list(cfg.interaction_branch1_layer_sizes),
            interaction_branch2_layer_sizes=list(cfg.interaction_branch2_layer_sizes),
        )
    return DLRM(**common)
