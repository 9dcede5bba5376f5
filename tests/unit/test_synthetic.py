"""Synthetic data: deterministic, Criteo-shaped, power-law ids, and a learnable planted model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from recsys.config import SyntheticConfig
from recsys.data.planted import PlantedModel, power_law_ranks
from recsys.data.synthetic import SyntheticCriteo

ROWS = [1000, 50, 20000] + [300] * 23


NAMES = [f"cat_{i}" for i in range(26)]


def source(batch: int = 512, **cfg) -> SyntheticCriteo:
    return SyntheticCriteo(SyntheticConfig(**cfg), ROWS, NAMES, 13, batch)


def test_batches_have_criteo_shape_and_valid_ids() -> None:
    b = source().batch("train", 0, 0)
    assert b.dense_features.shape == (512, 13) and b.dense_features.dtype == torch.float32
    assert b.labels.shape == (512,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    kjt = b.sparse_features
    assert kjt.keys() == NAMES
    for name, rows in zip(NAMES, ROWS, strict=True):
        jt = kjt[name]
        assert torch.all(jt.lengths() == 1)
        assert int(jt.values().min()) >= 0 and int(jt.values().max()) < rows


def test_batches_are_a_pure_function_of_split_index_rank() -> None:
    a, b = source(), source()
    x, y = a.batch("train", 7, 1), b.batch("train", 7, 1)
    assert torch.equal(x.dense_features, y.dense_features)
    assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
    assert torch.equal(x.labels, y.labels)
    other_rank = a.batch("train", 7, 0)
    held_out = a.batch("val", 7, 1)
    assert not torch.equal(x.sparse_features.values(), other_rank.sparse_features.values())
    assert not torch.equal(x.sparse_features.values(), held_out.sparse_features.values())


@pytest.mark.parametrize("exponent", [0.8, 1.0, 1.2])
def test_power_law_ranks_follow_the_exponent(exponent: float) -> None:
    rows = 10_000
    u = np.random.default_rng(0).random(400_000)
    counts = np.bincount(power_law_ranks(u, rows, exponent), minlength=rows)
    # share of the hottest 100 rows: the power law's CDF at x = 101, computed by hand
    if exponent == 1.0:
        expected = np.log(101) / np.log(rows + 1)
    else:
        e = 1 - exponent
        expected = (101**e - 1) / ((rows + 1) ** e - 1)
    assert counts[:100].sum() / counts.sum() == pytest.approx(expected, abs=0.005)
    # frequencies fall with rank: the hottest row beats row 100 by ~100^exponent
    ratio = counts[0] / max(counts[99], 1)
    assert 0.5 * 100**exponent < ratio < 2.0 * 100**exponent


def test_hot_rows_are_scattered_not_the_first_ids() -> None:
    ids = source(batch=4096).batch("train", 0, 0).sparse_features["cat_2"].values().numpy()
    values, counts = np.unique(ids, return_counts=True)
    hottest = values[np.argsort(counts)[::-1][:20]]
    assert hottest.max() > 1000  # not just ids 0..19


def test_planted_model_is_learnable_and_signal_zero_is_noise() -> None:
    def bayes_auc(signal: float) -> float:
        model = PlantedModel(SyntheticConfig(signal=signal), ROWS, 13)
        rng = np.random.default_rng(0)
        dense = rng.standard_normal((8192, 13))
        p = 1.0 / (1.0 + np.exp(-model.logits(dense, model.ids(rng, 8192))))
        labels = (rng.random(8192) < p).astype(np.int64)
        return float(binary_auroc(torch.from_numpy(p), torch.from_numpy(labels)))

    assert bayes_auc(1.0) > 0.75
    assert abs(bayes_auc(0.0) - 0.5) < 0.05


def test_bad_parameters_fail_clearly() -> None:
    with pytest.raises(ValueError, match="zipf_exponent"):
        source(zipf_exponent=0.0)
    with pytest.raises(ValueError, match="batch size"):
        source(batch=0)


def test_multi_hot_bags_have_each_tables_size_and_empty_bags_are_allowed() -> None:
    hotness = [0, 3] + [1] * 23 + [5]
    batch = source(64, hotness=hotness).batch("train", 2, 1)
    kjt = batch.sparse_features
    assert kjt.lengths().view(26, 64).tolist() == [[h] * 64 for h in hotness]
    for key, rows in zip(NAMES, ROWS, strict=True):
        ids = kjt[key].values()
        assert ids.dtype == torch.int64 and (len(ids) == 0 or int(ids.max()) < rows)
    again = source(64, hotness=hotness).batch("train", 2, 1).sparse_features
    assert torch.equal(kjt.values(), again.values())
    assert 0.1 < float(batch.labels.mean()) < 0.6  # bags still carry the planted signal


def test_one_hot_hotness_is_the_default_stream_and_mlperf_names_its_sizes() -> None:
    from recsys.data.multi_hot import MLPERF_HOTNESS

    plain = source(32).batch("train", 0, 0).sparse_features
    ones = source(32, hotness=[1] * 26).batch("train", 0, 0).sparse_features
    assert torch.equal(plain.values(), ones.values())
    mlperf = source(32, hotness="mlperf").batch("train", 0, 0).sparse_features
    assert mlperf.lengths().view(26, 32)[:, 0].tolist() == MLPERF_HOTNESS
    assert len(mlperf.values()) == 32 * sum(MLPERF_HOTNESS)


@pytest.mark.parametrize(
    ("hotness", "message"),
    [
        ([1, 2], "2 bag sizes but the model has 26 tables"),
        ([-1] + [1] * 25, ">= 0"),
        ("mlperf2", "'mlperf'"),
    ],
)
def test_bad_hotness_fails_naming_the_fix(hotness, message: str) -> None:
    from recsys.data.multi_hot import HotnessError

    with pytest.raises(HotnessError, match=message):
        source(8, hotness=hotness)
