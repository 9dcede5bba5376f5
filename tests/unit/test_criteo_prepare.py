"""Criteo TSV -> binary: rough edges, bad lines, gzip, chunking, workers, TorchRec parity."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from support import parse, random_rows, row, tsv

from recsys.data.convert import ConvertOptions, convert, input_files, output_name
from recsys.data.criteo_tsv import MalformedLineError
from recsys.data.prepare import PrepareConfig, prepare


def reference(text: bytes, has_label: bool = True):
    """The obvious per-line parser (TorchRec's row mapper) with padding for short lines."""
    out = []
    for line in text.decode().splitlines():
        f = line.split("\t")
        f += [""] * ((40 if has_label else 39) - len(f))
        off = 1 if has_label else 0
        out.append(
            (
                int(f[0] or 0) if has_label else -1,
                [int(x or 0) for x in f[off : off + 13]],
                [int(x or "0", 16) for x in f[off + 13 :]],
            )
        )
    return out


def test_values_land_in_place_with_missing_and_negative_values() -> None:
    ints = ["", "-2", "7", "", "123456789012", "0", "-1", "", "", "5", "", "", "9"]
    cats = ["", "ffffffff", "0000000a", "ABCDEF12", "1", "", *[f"{c:08x}" for c in range(20)]]
    chunk = parse(tsv(row("0", ints, cats)))
    assert chunk.labels_N.tolist() == [0]
    assert chunk.ints_NI[0].tolist() == [0, -2, 7, 0, 123456789012, 0, -1, 0, 0, 5, 0, 0, 9]
    assert chunk.cats_NC[0, :6].tolist() == [0, 0xFFFFFFFF, 10, 0xABCDEF12, 1, 0]
    assert chunk.cats_NC[0, 6:].tolist() == list(range(20))


def test_short_lines_are_padded_never_shifted_when_asked() -> None:
    full = row()
    stripped = full[:30]  # trailing 10 categorical fields stripped
    label_and_ints = full[:14]
    chunk = parse(tsv(full, stripped, label_and_ints), pad_short_lines=True)
    assert chunk.cats_NC[1, :16].tolist() == chunk.cats_NC[0, :16].tolist()
    assert chunk.cats_NC[1, 16:].tolist() == [0] * 10
    assert chunk.ints_NI[2].tolist() == list(range(13))
    assert chunk.cats_NC[2].tolist() == [0] * 26


@pytest.mark.parametrize(
    "bad, pad",
    [
        (row()[:7] + row()[8:], False),  # a middle count missing: every later column shifts
        (row()[:20] + row()[21:], False),  # a middle category missing
        (row()[:30], False),  # a stripped tail, not asked for
        (["1"], False),  # a label-only line is no sample
        (["1"], True),
        (row()[:5], True),  # padding takes only categories
    ],
)
def test_lines_with_too_few_fields_are_refused_or_skipped(bad: list[str], pad: bool) -> None:
    data = tsv(row("0"), bad, row("1"))
    with pytest.raises(
        MalformedLineError,
        match=r"f.txt:2: malformed Criteo line \(fewer than "
        f"{14 if pad else 40} fields",
    ):
        parse(data, pad_short_lines=pad)
    chunk = parse(data, skip=True, pad_short_lines=pad)
    assert chunk.bad_lines == 1 and chunk.labels_N.tolist() == [0, 1]


def test_a_last_line_without_newline_is_kept_and_reported() -> None:
    chunk = parse(tsv(row("0"), row("1"), final_newline=False))
    assert chunk.labels_N.tolist() == [0, 1] and chunk.unterminated
    assert not parse(tsv(row("0"), row("1"))).unterminated


def test_a_file_cut_mid_line_is_reported_as_cut() -> None:
    data = tsv(row("0"), row("1"))[:-60]  # the last line loses its last categories
    with pytest.raises(
        MalformedLineError,
        match=r"f.txt:2: .*the file ends in the middle of "
        "this line",
    ):
        parse(data, pad_short_lines=True)
    chunk = parse(data, skip=True)
    assert chunk.labels_N.tolist() == [0] and chunk.bad_lines == 1


def test_counts_below_the_floor_are_refused_naming_the_value_or_clipped() -> None:
    ints = ["1", "-3", "7", "-99999999999"] + ["2"] * 9
    data = tsv(row("0"), row("1", ints), row("1"))
    with pytest.raises(
        MalformedLineError,
        match=r"f.txt:2: .*count I4 is -99999999999, below "
        r"dense_floor=-3; pass clip_dense=true",
    ):
        parse(data)
    chunk = parse(data, clip_dense=True)
    assert chunk.ints_NI[1].tolist() == [1, -3, 7, -3] + [2] * 9
    assert chunk.clipped_I.tolist() == [0, 0, 0, 1] + [0] * 9
    assert parse(data, dense_floor=-(10**12)).ints_NI[1, 3] == -99999999999


def test_very_large_integers_are_exact_or_rejected() -> None:
    big = row(ints=["9223372036854775807", "-9223372036854775808"] + ["1"] * 11)
    chunk = parse(tsv(big), dense_floor=-(2**63))  # exact parsing, whatever the floor
    assert chunk.ints_NI[0, :2].tolist() == [2**63 - 1, -(2**63)]
    with pytest.raises(MalformedLineError, match="f.txt:1: .*a count is not an integer"):
        parse(tsv(row(ints=["9223372036854775808"] + ["1"] * 12)))


@pytest.mark.parametrize(
    "bad,why",
    [
        (row(cats=["xyz"] + ["1"] * 25), "a category is not hex"),
        (row(cats=["123456789"] + ["1"] * 25), "a category is not hex of at most 8"),
        (row(ints=["1.5"] + ["1"] * 12), "a count is not an integer"),
        (row(ints=["-"] + ["1"] * 12), "a count is not an integer"),
        (row(label="2"), "label is not 0 or 1"),
        (row() + ["extra"], "more than 40 fields"),
    ],
)
def test_malformed_lines_name_file_and_line_or_are_skipped(bad: list[str], why: str) -> None:
    data = tsv(row("0"), row("1"), bad, row("1"))
    with pytest.raises(MalformedLineError, match=f"f.txt:3: malformed Criteo line \\({why}"):
        parse(data)
    chunk = parse(data, skip=True)
    assert chunk.bad_lines == 1
    assert chunk.labels_N.tolist() == [0, 1, 1]
    assert chunk.ints_NI.shape == (3, 13)


def test_kaggle_test_file_has_no_label_column() -> None:
    chunk = parse(tsv(row(None), row(None)[:20]), has_label=False, pad_short_lines=True)
    assert chunk.labels_N.tolist() == [-1, -1]
    assert chunk.ints_NI[0].tolist() == list(range(13))


def test_the_kaggle_tarballs_readme_is_not_taken_for_data(tmp_path) -> None:
    """dac.tar.gz unpacks to train.txt, test.txt and readme.txt: the last is prose."""
    for name in ("train.txt", "test.txt", "readme.txt", "LICENSE.txt"):
        (tmp_path / name).write_text("x\n")
    assert [p.name for p in input_files(tmp_path)] == ["test.txt", "train.txt"]


def test_random_text_matches_the_reference_parser() -> None:
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(500):
        ints = [
            ("" if rng.random() < 0.2 else str(int(rng.integers(-5, 10**7)))) for _ in range(13)
        ]
        cats = [
            ("" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):x}") for _ in range(26)
        ]
        r = row(str(int(rng.integers(0, 2))), ints, cats)
        rows.append(r[: int(rng.integers(20, 41))] if rng.random() < 0.3 else r)
    data = tsv(*rows)
    chunk = parse(data, pad_short_lines=True, dense_floor=-5)
    for i, (label, ints, cats) in enumerate(reference(data)):
        assert chunk.labels_N[i] == label
        assert chunk.ints_NI[i].tolist() == ints
        assert chunk.cats_NC[i].tolist() == cats


def write_files(tmp: Path, rows: list[list[str]]) -> tuple[Path, Path]:
    data = tsv(*rows, final_newline=False)
    plain = tmp / "in" / "day_0"
    plain.parent.mkdir(parents=True, exist_ok=True)
    plain.write_bytes(data)
    gz = tmp / "gz" / "day_0.gz"
    gz.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(gz, "wb") as f:
        f.write(data)
    return plain, gz


def load(out: Path, name: str):
    return [np.load(out / f"{name}_{k}.npy") for k in ("dense", "sparse", "labels")]


def test_gzip_chunks_and_workers_give_identical_files(tmp_path: Path) -> None:
    plain, gz = write_files(tmp_path, random_rows(3000))
    tiny_chunks = ConvertOptions(chunk_mb=0.01, workers=1, progress=False)
    convert(plain, tmp_path / "a", ConvertOptions(workers=1, progress=False))
    convert(gz, tmp_path / "b", tiny_chunks)  # ~40 chunks, lines cut at block edges
    convert(plain, tmp_path / "c", ConvertOptions(chunk_mb=0.01, workers=2, progress=False))
    a = load(tmp_path / "a", "day_0")
    for other in ("b", "c"):
        for x, y in zip(a, load(tmp_path / other, "day_0"), strict=True):
            assert np.array_equal(x, y)
    assert a[1].shape == (3000, 26) and a[2].shape == (3000, 1) and a[0].dtype == np.float32


def test_bad_line_number_is_right_across_chunks(tmp_path: Path) -> None:
    rows = random_rows(2000)
    rows[1533] = row(cats=["nothex!"] + ["1"] * 25)
    plain, _ = write_files(tmp_path, rows)
    with pytest.raises(MalformedLineError, match=r"day_0:1534: "):
        convert(plain, tmp_path / "o", ConvertOptions(chunk_mb=0.01, workers=2, progress=False))


def test_prepare_summary_counts_rows_and_skipped_lines(tmp_path: Path) -> None:
    rows = random_rows(100)
    rows[10] = row(ints=["x"] * 13)
    rows[20] = row() + ["1", "2"]
    plain, _ = write_files(tmp_path, rows)
    cfg = PrepareConfig(
        input=str(plain.parent),
        output=str(tmp_path / "o"),
        skip_bad_lines=True,
        workers=1,
        progress=False,
    )
    summary = prepare(cfg)
    assert summary["rows"] == 98 and summary["bad_lines"] == 2
    assert [f["name"] for f in summary["files"]] == ["day_0"]
    on_disk = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert on_disk["rows"] == 98 and on_disk["bad_lines"] == 2 and len(on_disk["files"]) == 1


def test_output_names_drop_text_extensions() -> None:
    assert output_name(Path("day_0.gz")) == "day_0"
    assert output_name(Path("train.txt")) == "train"
    assert output_name(Path("test.txt.gz")) == "test"
    assert output_name(Path("day_23")) == "day_23"


def test_same_arrays_as_torchrecs_own_converter(tmp_path: Path) -> None:
    from torchrec.datasets.criteo import BinaryCriteoUtils

    rows = random_rows(500, seed=5)
    src = tmp_path / "day_0.tsv"
    src.write_bytes(tsv(*rows))
    theirs = [tmp_path / f"t_{k}.npy" for k in ("dense", "sparse", "labels")]
    BinaryCriteoUtils.tsv_to_npys(str(src), *map(str, theirs))
    convert(src, tmp_path / "ours", ConvertOptions(workers=1, progress=False))
    for ours, t in zip(load(tmp_path / "ours", "day_0"), theirs, strict=True):
        expected = np.load(t)
        assert ours.dtype == expected.dtype and ours.shape == expected.shape
        assert np.array_equal(ours, expected)


def test_multi_hot_files_in_torchrecs_layout_are_read_as_bags(tmp_path: Path) -> None:
    """`prepare hotness=...` writes <name>_sparse_multi_hot.npz, one [rows, size] array per
    table named "0".."25"; a bag is a function of the one-hot id, which comes first."""
    from recsys.data.criteo_binary import CriteoBinary
    from recsys.data.multi_hot import HotnessError

    plain, _ = write_files(tmp_path, random_rows(200, seed=3))
    hotness = [2, 0, 1, 4] + [1] * 21 + [3]
    out = tmp_path / "o"
    summary = prepare(
        PrepareConfig(
            input=str(plain.parent), output=str(out), workers=1, progress=False, hotness=hotness
        )
    )
    assert summary["hotness"] == hotness
    with np.load(out / "day_0_sparse_multi_hot.npz") as npz:
        assert sorted(npz.files, key=int) == [str(t) for t in range(26)]
        arrays = [npz[str(t)] for t in range(26)]
    sparse = np.load(out / "day_0_sparse.npy")
    assert [a.shape for a in arrays] == [(200, h) for h in hotness]
    assert np.array_equal(arrays[0][:, 0], sparse[:, 0])  # the one-hot id first
    same = sparse[:, 3] == sparse[0, 3]
    assert (arrays[3][same] == arrays[3][0]).all()  # the same id, the same bag

    rows = [97] * 26
    names = [f"cat_{i}" for i in range(26)]
    data = CriteoBinary(out, rows, names, 4, 2, hotness=hotness)
    kjt = data.batch("train", 0, 1).sparse_features
    assert kjt.lengths().view(26, 4)[:, 0].tolist() == hotness
    assert int(kjt.values().max()) < 97 and len(kjt["cat_1"].values()) == 0
    with pytest.raises(HotnessError, match="not dataset.hotness=.*prepare"):
        CriteoBinary(out, rows, names, 4, 2, hotness=[1] * 26)
    (out / "day_0_sparse_multi_hot.npz").unlink()
    with pytest.raises(HotnessError, match="does not exist.*hotness="):
        CriteoBinary(out, rows, names, 4, 2, hotness=hotness)


def test_multi_hot_files_are_written_a_chunk_at_a_time(tmp_path: Path) -> None:
    """Bounded memory: chunks of 7 rows give the same arrays as one pass."""
    from recsys.data.multi_hot import expand, write_multi_hot

    plain, _ = write_files(tmp_path, random_rows(50, seed=4))
    out = tmp_path / "o"
    prepare(PrepareConfig(input=str(plain.parent), output=str(out), workers=1, progress=False))
    write_multi_hot(out, ["day_0"], [3, 0] + [2] * 24, chunk_rows=7, progress=False)
    sparse = np.load(out / "day_0_sparse.npy")
    with np.load(out / "day_0_sparse_multi_hot.npz") as npz:
        assert np.array_equal(npz["0"], expand(sparse[:, 0], 0, 3))
        assert npz["1"].shape == (50, 0) and np.array_equal(npz["25"], expand(sparse[:, 25], 25, 2))
    assert not list(out.glob(".*_multi_hot_*.npy"))  # the temporaries are gone
