"""Synthetic Criteo files -> prepare -> loader: values equal the text, shards, splits, remap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config

from recsys.data.convert import ConvertOptions, convert
from recsys.data.criteo_binary import CriteoBinary, CriteoDataError
from recsys.data.remap import RemapConfig, remap
from recsys.data.synthetic_files import Preset, SynthConfig, cardinalities, synthesize

NAMES = [f"cat_{i}" for i in range(26)]


ROWS = [1000] * 26


def text_rows(path: Path) -> list[tuple[int, list[int], list[int]]]:
    import gzip

    out = []
    with gzip.open(path, "rt") as f:
        for line in f.read().splitlines():
            fields = line.split("\t") + [""] * 40
            out.append(
                (
                    int(fields[0]),
                    [int(x or 0) for x in fields[1:14]],
                    [int(x or "0", 16) for x in fields[14:40]],
                )
            )
    return out


def test_round_trip_batches_equal_the_text(kaggle_files) -> None:
    tsv, binary = kaggle_files
    rows = text_rows(tsv / "train.txt.gz")
    assert len(rows) == 6000
    low = min(min(ints) for _, ints, _ in rows)
    src = CriteoBinary(binary, ROWS, NAMES, batch_size=100, world_size=1, shuffle_chunk_batches=0)
    for index in (0, 7):
        b = src.batch("train", index, 0)
        for i in (0, 55, 99):
            label, ints, cats = rows[index * 100 + i]
            assert b.labels[i] == label
            expected = np.log(np.array(ints, dtype=np.float64) - low + 2).astype(np.float32)
            assert torch.allclose(b.dense_features[i], torch.from_numpy(expected))
            ids = [int(b.sparse_features[n].values()[i]) for n in NAMES]
            assert ids == [c % 1000 for c in cats]


def test_unlabeled_test_file_is_converted_but_not_trained_on(kaggle_files) -> None:
    _, binary = kaggle_files
    assert (np.load(binary / "test_labels.npy") == -1).all()
    src = CriteoBinary(binary, ROWS, NAMES, batch_size=100, world_size=1)
    assert src.names == ["train"]


def test_torchrecs_reader_reads_our_files(kaggle_files) -> None:
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    _, binary = kaggle_files
    paths = {k: [str(binary / f"train_{k}.npy")] for k in ("dense", "sparse", "labels")}
    pipe = InMemoryBinaryCriteoIterDataPipe(
        "train",
        paths["dense"],
        paths["sparse"],
        paths["labels"],
        batch_size=64,
        rank=0,
        world_size=1,
        hashes=ROWS,
    )
    theirs = next(iter(pipe))
    ours = CriteoBinary(binary, ROWS, NAMES, 64, 1, shuffle_chunk_batches=0).batch("train", 0, 0)
    assert torch.equal(theirs.dense_features, ours.dense_features)
    assert torch.equal(theirs.labels.float(), ours.labels)
    assert torch.equal(theirs.sparse_features.values(), ours.sparse_features.values())


def test_ranks_read_disjoint_shares_and_shuffling_is_a_permutation(kaggle_files) -> None:
    _, binary = kaggle_files
    src = CriteoBinary(binary, ROWS, NAMES, batch_size=50, world_size=2, shuffle_chunk_batches=4)
    n = src.num_batches("train")
    assert n == (6000 - 857) // 2 // 50  # 1/7 held out; the remainder dropped
    seen = {r: [src._position("train", i) for i in range(n)] for r in (0, 1)}
    assert sorted(seen[0]) == list(range(n))
    assert seen[0] != list(range(n))  # chunk order really shuffled
    assert [src._position("train", i) for i in range(n, 2 * n)] != seen[0]  # new epoch, new order
    first = {r: src.batch("train", 0, r).dense_features for r in (0, 1)}
    assert not torch.equal(first[0], first[1])
    again = CriteoBinary(binary, ROWS, NAMES, batch_size=50, world_size=2, shuffle_chunk_batches=4)
    assert torch.equal(
        again.batch("train", 3, 1).dense_features, src.batch("train", 3, 1).dense_features
    )
    assert src.num_batches("val") == (6000 - 5143 + 1) // 2 // 2 // 50


def test_unequal_batch_shares_read_disjoint_rows_in_proportion(kaggle_files) -> None:
    """A speed-aware split: rank 1 takes twice rank 0's batch; the ranks' shares of the
    rows are in that proportion, never overlap, and last as many batches."""
    _, binary = kaggle_files
    src = CriteoBinary(binary, ROWS, NAMES, 0, 0, shuffle_chunk_batches=0, batch_per_rank=[40, 80])
    n = src.num_batches("train")
    assert n == (6000 - 857) // 120
    rows = {}
    for r, size in ((0, 40), (1, 80)):
        batches = [src.batch("train", i, r) for i in range(n)]
        assert all(len(b.labels) == size and b.sparse_features.stride() == size for b in batches)
        rows[r] = torch.cat([b.dense_features for b in batches])
    assert len(rows[1]) == 2 * len(rows[0])
    mine = {tuple(x.tolist()) for x in rows[0]}
    assert not mine & {tuple(x.tolist()) for x in rows[1]}  # disjoint (rows are distinct)
    equal = CriteoBinary(binary, ROWS, NAMES, batch_size=50, world_size=2, shuffle_chunk_batches=0)
    same = CriteoBinary(binary, ROWS, NAMES, 0, 0, shuffle_chunk_batches=0, batch_per_rank=[50, 50])
    for r in (0, 1):  # equal shares: the same rows as before
        assert torch.equal(
            equal.batch("train", 2, r).dense_features, same.batch("train", 2, r).dense_features
        )


def test_day_files_hold_out_the_last_day(tmp_path: Path) -> None:
    synthesize(
        SynthConfig(
            output=str(tmp_path / "tsv"), preset=Preset.criteo_1tb, files=3, rows=1000, scale=10_000
        )
    )
    convert(tmp_path / "tsv", tmp_path / "bin", ConvertOptions(workers=1, progress=False))
    src = CriteoBinary(tmp_path / "bin", ROWS, NAMES, batch_size=100, world_size=1)
    assert src.names == ["day_0", "day_1", "day_2"]
    assert src.split_range("train") == (0, 2000)
    assert src.split_range("val") == (2000, 2500) and src.split_range("test") == (2500, 3000)


def test_missing_or_too_small_data_is_a_clear_error(tmp_path: Path, kaggle_files) -> None:
    with pytest.raises(CriteoDataError, match="python -m recsys.data.prepare"):
        CriteoBinary(tmp_path, ROWS, NAMES, 10, 1)
    with pytest.raises(CriteoDataError, match="fewer than one batch"):
        CriteoBinary(kaggle_files[1], ROWS, NAMES, batch_size=5000, world_size=2)


def test_frequency_threshold_remap(tmp_path: Path) -> None:
    from recsys.data.npy_io import NpyAppender

    src = tmp_path / "bin"
    src.mkdir()
    sparse = np.zeros((10, 26), dtype=np.int64)
    sparse[:, 0] = [7, 7, 7, 9, 9, 5, 5, 5, 5, 100]  # 7 x3, 9 x2, 5 x4, 100 x1
    sparse[:, 1] = np.arange(10) + 1000
    for name, arr in (
        ("sparse", sparse),
        ("dense", np.zeros((10, 13), np.float32)),
        ("labels", np.zeros((10, 1), np.int32)),
    ):
        with NpyAppender(src / f"train_{name}.npy", arr.dtype, arr.shape[1]) as w:
            w.append(arr)
    result = remap(
        RemapConfig(input=str(src), output=str(tmp_path / "out"), threshold=3, progress=False)
    )
    out = np.load(tmp_path / "out" / "train_sparse.npy")
    assert out[:, 0].tolist() == [2, 2, 2, 0, 0, 1, 1, 1, 1, 0]  # kept 5 -> 1, 7 -> 2
    assert out[:, 1].tolist() == [0] * 10  # every id seen once: all share row 0
    assert result["num_embeddings_per_feature"][:2] == [3, 1]
    assert json.loads((tmp_path / "out" / "remap.json").read_text())["threshold"] == 3
    # the override that gives a model these tables, composed as a training run takes it
    override = (tmp_path / "out" / "model_override.txt").read_text().strip()
    assert override == result["model_override"]
    cfg = compose_config(["dataset=criteo_kaggle", f"dataset.path={tmp_path / 'out'}", override])
    assert list(cfg.model.num_embeddings_per_feature) == result["num_embeddings_per_feature"]
    modded = remap(
        RemapConfig(
            input=str(src),
            output=str(tmp_path / "mod"),
            threshold=1,
            max_ind_range=4,
            progress=False,
        )
    )
    assert modded["num_embeddings_per_feature"][1] == 1 + 4  # 1000..1009 % 4 -> 4 ids


def test_synth_cardinalities_scale_the_presets() -> None:
    kaggle = cardinalities(SynthConfig(scale=1000))
    assert kaggle[2] == 10131 and kaggle[8] == 1  # 10,131,227 / 1000; 3 / 1000 -> at least 1
    assert max(cardinalities(SynthConfig(preset=Preset.criteo_1tb, scale=1))) == 40_000_000
