"""The batch source a dataset config (`recsys.config.DatasetConfig`, `conf/dataset/`) names.

A source gives deterministic batches: `batches(split, start, stop, rank)` with split
"train", or "val" or "test" (held out), so a run's data position is just its step;
`num_batches(split)` says how many a rank has (None: no end, synthetic data).
"""

from __future__ import annotations

from pathlib import Path

from recsys.config import DataKind, DatasetConfig, EvalSplit, ModelConfig
from recsys.data.criteo_binary import CriteoBinary, CriteoDataError
from recsys.data.multi_hot import resolve_hotness
from recsys.data.synthetic import SyntheticCriteo
from recsys.models.dlrm import feature_names


def build_source(
    cfg: DatasetConfig,
    model: ModelConfig,
    batch_size: int,
    world_size: int,
    batch_per_rank: list[int] | None = None,
) -> SyntheticCriteo | CriteoBinary:
    """Batches of `batch_size` for this rank (`batch_per_rank`: every rank's own size)."""
    if DataKind(cfg.kind) == DataKind.synthetic:
        return SyntheticCriteo(
            cfg,
            list(model.num_embeddings_per_feature),
            feature_names(model),
            model.dense_in_features,
            batch_size,
        )
    if not cfg.path:
        raise CriteoDataError(
            f"dataset '{cfg.name}' needs dataset.path: the output directory of "
            f"`python -m recsys.data.prepare input=<tsv> output=<a new directory>`"
        )
    if cfg.make and not Path(cfg.path).is_dir():
        raise CriteoDataError(
            f"dataset '{cfg.name}': '{cfg.path}' does not exist; make it with "
            f"`{cfg.make.format(path=cfg.path)}`"
        )
    return CriteoBinary(
        cfg.path,
        list(model.num_embeddings_per_feature),
        feature_names(model),
        batch_size,
        world_size,
        holdout_fraction=cfg.holdout_fraction,
        shuffle_chunk_batches=cfg.shuffle_chunk_batches,
        seed=cfg.seed,
        batch_per_rank=batch_per_rank,
        hotness=resolve_hotness(cfg.hotness, len(model.num_embeddings_per_feature)),
        held_out=EvalSplit(cfg.eval_split).value if cfg.eval_batches != 0 else None,
        dense_features=model.dense_in_features,
    )
