"""Bad input on the data path: outputs appear whole or not at all, never mixed, and each rough
file gets one line naming it (and the line)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from support import input_file, parse, random_rows, row, small_disk, tsv

from recsys.data.atomic import OutputDirError, atomic_dir
from recsys.data.criteo_binary import CriteoBinary, CriteoDataError
from recsys.data.criteo_tsv import BadInputError, MalformedLineError
from recsys.data.prepare import PrepareConfig, prepare
from recsys.data.remap import RemapConfig, remap
from recsys.data.synthetic_files import SynthConfig, synthesize


def _prepare(src: Path, out: Path, **kw) -> dict:
    return prepare(PrepareConfig(input=str(src), output=str(out), workers=1, progress=False, **kw))


def _listing(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_failed_prepare_leaves_the_previous_output_as_it_was(tmp_path: Path) -> None:
    good = input_file(tmp_path, "day_0", tsv(*random_rows(200)))
    out = tmp_path / "out"
    _prepare(good.parent, out)
    before = _listing(out)
    bad_rows = random_rows(200)
    bad_rows[150] = row(cats=["nothex!"] * 26)
    bad = tmp_path / "other" / "day_0"
    bad.parent.mkdir()
    bad.write_bytes(tsv(*bad_rows))
    with pytest.raises(OutputDirError, match="not empty; pass overwrite=true"):
        _prepare(bad.parent, out)
    with pytest.raises(MalformedLineError, match="day_0:151"):
        _prepare(bad.parent, out, overwrite=True)
    assert _listing(out) == before  # nothing of the failed run, nothing lost
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_overwrite_replaces_the_directory_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "day_7_dense.npy").write_bytes(b"stale")  # another dataset's file
    _prepare(input_file(tmp_path, "train.txt", tsv(*random_rows(300))).parent, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "summary.json",
        "train_dense.npy",
        "train_labels.npy",
        "train_sparse.npy",
    ]


def test_an_empty_output_directory_is_used_and_a_file_is_refused(tmp_path: Path) -> None:
    src = input_file(tmp_path, "day_0", tsv(*random_rows(50))).parent
    (tmp_path / "empty").mkdir()
    assert _prepare(src, tmp_path / "empty")["rows"] == 50
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        _prepare(src, tmp_path / "afile")


def test_an_unwritable_output_is_one_line(tmp_path: Path) -> None:
    src = input_file(tmp_path, "day_0", tsv(*random_rows(50))).parent
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway: make the parent a file instead
            target = tmp_path / "afile2" / "out"
            (tmp_path / "afile2").write_text("x")
        else:
            target = locked / "out"
        with pytest.raises(OutputDirError, match="cannot write to output"):
            _prepare(src, target)
    finally:
        locked.chmod(0o700)


def test_outputs_take_the_default_directory_mode(tmp_path: Path) -> None:
    """Others sharing the filesystem can read a prepared directory as they can any other
    (mkdtemp's 0700 is not kept): the mode a plain mkdir gives under the umask."""
    import os

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a.npy").write_bytes(b"1234")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_interrupted_work_is_removed_and_said_so(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), atomic_dir(out) as tmp:
        (tmp / "half.npy").write_bytes(b"1234")
        raise KeyboardInterrupt
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert "removed the partial output" in capsys.readouterr().err


def test_synth_and_remap_write_whole_directories_too(tmp_path: Path) -> None:
    tsv_dir = tmp_path / "tsv"
    synthesize(SynthConfig(output=str(tsv_dir), rows=2000, scale=1000))
    with pytest.raises(OutputDirError, match="not empty"):
        synthesize(SynthConfig(output=str(tsv_dir), rows=10, scale=1000))
    synthesize(SynthConfig(output=str(tsv_dir), rows=10, scale=1000, overwrite=True))
    assert len((tsv_dir / "train.txt").read_text().splitlines()) == 10
    _prepare(tsv_dir, tmp_path / "bin")
    remap(RemapConfig(input=str(tmp_path / "bin"), output=str(tmp_path / "re"), progress=False))
    with pytest.raises(OutputDirError, match="not empty"):
        remap(RemapConfig(input=str(tmp_path / "bin"), output=str(tmp_path / "re")))


def test_blank_lines_are_refused_by_line_or_skipped_and_counted() -> None:
    data = tsv(row("0"), row("1")) + b"\n" + tsv(row("1"))
    with pytest.raises(MalformedLineError, match=r"f.txt:3: malformed Criteo line \(blank line"):
        parse(data)
    chunk = parse(data, skip=True)
    assert chunk.bad_lines == 1 and chunk.labels_N.tolist() == [0, 1, 1]


def test_crlf_line_endings_read_as_lf() -> None:
    plain = tsv(row("0"), row("1", cats=[f"{c:08x}" for c in range(26)]), row("1")[:20])
    crlf = plain.replace(b"\n", b"\r\n")
    a, b = parse(plain, pad_short_lines=True), parse(crlf, pad_short_lines=True)
    for x, y in ((a.labels_N, b.labels_N), (a.ints_NI, b.ints_NI), (a.cats_NC, b.cats_NC)):
        assert np.array_equal(x, y)


def test_an_empty_label_is_refused_naming_the_line() -> None:
    with pytest.raises(MalformedLineError, match=r"f.txt:2: malformed Criteo line \(the label is"):
        parse(tsv(row("0"), row("")))


def test_an_empty_file_and_a_truncated_gzip_are_one_line_each(tmp_path: Path) -> None:
    empty = input_file(tmp_path, "day_0", b"")
    with pytest.raises(BadInputError, match=r"day_0: the file is empty"):
        _prepare(empty, tmp_path / "o1")
    whole = gzip.compress(tsv(*random_rows(3000)))
    cut = input_file(tmp_path / "gz", "day_0.gz", whole[: len(whole) // 2])
    with pytest.raises(BadInputError, match=r"day_0.gz: truncated or corrupt gzip"):
        _prepare(cut, tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_file_of_only_bad_lines_fails_even_when_skipping(tmp_path: Path) -> None:
    src = input_file(tmp_path, "day_0", tsv(row("7"), row("x")) + b"\n\n")
    with pytest.raises(
        BadInputError,
        match=r"every line is malformed \(4 lines\); the first: "
        r".*day_0:1: malformed Criteo line \(label is not 0 or 1",
    ):
        _prepare(src, tmp_path / "o", skip_bad_lines=True)


def _loader(path: Path) -> CriteoBinary:
    return CriteoBinary(path, [1000] * 26, [f"cat_{i}" for i in range(26)], 8, 1)


def test_the_loader_refuses_files_its_summary_does_not_list(tmp_path: Path) -> None:
    out = tmp_path / "bin"
    _prepare(input_file(tmp_path, "train.txt", tsv(*random_rows(400))).parent, out)
    _loader(out)  # as prepared: fine
    for kind in ("dense", "sparse", "labels"):  # a stray file of another run
        arr = np.load(out / f"train_{kind}.npy")
        np.save(out / f"extra_{kind}.npy", arr[:100])
    with pytest.raises(
        CriteoDataError,
        match=r"extra_\*.npy': the directory holds 100 rows, "
        r"its summary.json says nothing",
    ):
        _loader(out)


def test_the_loader_refuses_two_layouts_in_one_directory(tmp_path: Path) -> None:
    out = tmp_path / "bin"
    _prepare(input_file(tmp_path, "train.txt", tsv(*random_rows(400))).parent, out)
    (out / "summary.json").unlink()
    for kind in ("dense", "sparse", "labels"):
        np.save(out / f"day_0_{kind}.npy", np.load(out / f"train_{kind}.npy"))
    with pytest.raises(CriteoDataError, match=r"mixes two layouts: \['day_0'\] .* \['train'\]"):
        _loader(out)


def test_profile_refuses_a_zero_sketch_and_negative_hot_ids() -> None:
    from recsys.app.profile import ProfileAppConfig, check_profile_config

    with pytest.raises(ValueError, match="sketch_capacity must be >= 1, got 0"):
        check_profile_config(ProfileAppConfig(sketch_capacity=0))
    with pytest.raises(ValueError, match="hot_ids must be >= 0, got -1"):
        check_profile_config(ProfileAppConfig(hot_ids=-1))


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_prepare_never_writes_over_its_input_whatever_overwrite_says(
    tmp_path: Path, where: str
) -> None:
    raw = tmp_path / "data" / "raw"
    input_file(tmp_path, "train.txt", tsv(*random_rows(100))).rename(tmp_path / "train.txt")
    raw.mkdir(parents=True)
    (tmp_path / "train.txt").rename(raw / "train.txt")
    out = {"same": raw, "parent": raw.parent, "inside": raw / "bin"}[where]
    before = _tree(tmp_path / "data")
    for src in (raw, raw / "train.txt"):  # a directory or one file as the input
        if where == "inside" and src.is_file():
            continue  # nothing lies inside a file
        how = {"same": "is", "parent": "contains", "inside": "lies inside"}[where]
        how = "contains" if src.is_file() else how
        with pytest.raises(OutputDirError, match=f"output '{out}' {how} the input '{src}'"):
            _prepare(src, out, overwrite=True)
    assert _tree(tmp_path / "data") == before


def test_remap_never_writes_over_its_input(tmp_path: Path) -> None:
    bin_dir = tmp_path / "data" / "bin"
    _prepare(input_file(tmp_path, "train.txt", tsv(*random_rows(200))).parent, bin_dir)
    before = _tree(tmp_path / "data")
    for out in (bin_dir, bin_dir.parent, bin_dir / "re"):
        with pytest.raises(OutputDirError, match="the input"):
            remap(RemapConfig(input=str(bin_dir), output=str(out), overwrite=True, progress=False))
    assert _tree(tmp_path / "data") == before


def test_the_trainers_advice_for_a_raw_directory_names_a_new_output(tmp_path: Path) -> None:
    raw = input_file(tmp_path, "train.txt", tsv(*random_rows(10))).parent
    with pytest.raises(CriteoDataError) as e:
        _loader(raw)
    assert f"input={raw} output={raw}_binary" in str(e.value)
    assert f"output={raw} " not in str(e.value) + " "


def _dense_of(out: Path, name: str = "train") -> np.ndarray:
    return np.load(out / f"{name}_dense.npy")


def test_one_huge_negative_count_is_refused_by_file_line_or_clipped_and_counted(
    tmp_path: Path,
) -> None:
    rows = random_rows(300)
    rows[120] = row(ints=["5"] * 6 + ["-99999999999"] + ["5"] * 6)
    src = input_file(tmp_path, "train.txt", tsv(*rows))
    with pytest.raises(
        MalformedLineError,
        match=r"train.txt:121: .*count I7 is -99999999999, "
        r"below dense_floor=-3; pass clip_dense=true",
    ):
        _prepare(src, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    summary = _prepare(src, tmp_path / "clipped", clip_dense=True)
    dense = _dense_of(tmp_path / "clipped")
    assert summary["dense"] == {
        "transform": "torchrec",
        "floor": -3,
        "shift": None,
        "clip": True,
        "clipped": 1,
    }
    f = summary["files"][0]
    assert f["dense_clipped"] == [0] * 6 + [1] + [0] * 6 and f["dense_min"][6] == -3
    assert f["dense_shift"] == -3 and f["dense_max"][6] <= 1000
    assert dense[120, 6] == np.float32(np.log(2))  # clipped to the floor: log(-3 + 3 + 2)
    assert dense.std(axis=0).min() > 0.5  # not flattened (one cell unclipped: ~3e-4..0.8)
    recorded = json.loads((tmp_path / "clipped" / "summary.json").read_text())
    assert recorded["dense"] == summary["dense"]


def test_a_fixed_dense_shift_maps_a_count_the_same_in_every_file(tmp_path: Path) -> None:
    day0 = random_rows(100, seed=1)
    day1 = [row(r[0], [x.lstrip("-") for x in r[1:14]], r[14:]) for r in random_rows(100, seed=2)]
    day0[0] = row(ints=["-3"] + ["7"] * 12)
    day1[0] = row(ints=["-1"] + ["7"] * 12)
    src = tmp_path / "days"
    src.mkdir()
    (src / "day_0").write_bytes(tsv(*day0))
    (src / "day_1").write_bytes(tsv(*day1))
    per_file = _prepare(src, tmp_path / "per_file")
    assert [f["dense_shift"] for f in per_file["files"]] == [-3, -1]
    a = [_dense_of(tmp_path / "per_file", n)[0, 1] for n in ("day_0", "day_1")]
    assert a[0] != a[1]  # TorchRec's per-file minimum: count 7 maps differently per day
    fixed = _prepare(src, tmp_path / "fixed", dense_shift=-3)
    b = [_dense_of(tmp_path / "fixed", n)[0, 1] for n in ("day_0", "day_1")]
    assert b[0] == b[1] == np.float32(np.log(7 + 3 + 2))
    assert fixed["dense"]["shift"] == -3 and [f["dense_shift"] for f in fixed["files"]] == [-3, -3]
    with pytest.raises(MalformedLineError, match=r"count I1 is -3, below dense_floor=-2"):
        _prepare(src, tmp_path / "above", dense_shift=-2)  # counts below the shift: refused
    with pytest.raises(BadInputError, match=r"dense_shift=4: must be <= 0"):
        _prepare(src, tmp_path / "positive", dense_shift=4)


def test_the_log1p_transform_is_the_dlrm_references(tmp_path: Path) -> None:
    rows = random_rows(50)
    rows[0] = row(ints=["-2", "0", "1", "", "1000"] + ["3"] * 8)
    out = tmp_path / "o"
    summary = _prepare(input_file(tmp_path, "train.txt", tsv(*rows)), out, dense_transform="log1p")
    expected = np.log(np.float32([0, 0, 1, 0, 1000] + [3] * 8) + 1, dtype=np.float32)
    assert np.array_equal(_dense_of(out)[0], expected)
    assert summary["dense"]["transform"] == "log1p" and summary["files"][0]["dense_shift"] is None


def test_two_writers_of_one_output_cannot_both_succeed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_dir(out) as first:
        (first / "a.npy").write_bytes(b"first")
        with pytest.raises(
            OutputDirError,
            match=rf"output '{out}' is being written by another "
            rf"command \(pid {os.getpid()}\); wait for it, or name another "
            r"output",
        ):
            with atomic_dir(out, overwrite=True):
                pass
    assert _listing(out) == {"a.npy": b"first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file left


def test_an_output_that_appeared_meanwhile_is_not_replaced(tmp_path: Path) -> None:
    """A writer that took no lock (another tool) filled the output while this one wrote."""
    out = tmp_path / "out"
    with pytest.raises(OutputDirError, match="appeared while this command wrote it"):
        with atomic_dir(out) as tmp:
            (tmp / "mine.npy").write_bytes(b"mine")
            out.mkdir()
            (out / "theirs.npy").write_bytes(b"theirs")
    assert _listing(out) == {"theirs.npy": b"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_prepare_on_a_full_disk_is_one_line_and_keeps_nothing(tmp_path: Path) -> None:
    src = input_file(tmp_path, "train.txt", tsv(*random_rows(3000))).parent
    with small_disk(tmp_path / "disk", "64k") as disk:
        with pytest.raises(OutputDirError) as e:
            _prepare(src, disk / "bin")
        assert str(e.value) == (
            f"disk full writing output '{disk / 'bin'}' (No space left on device): nothing was "
            f"kept; free space there or name an output on another disk"
        )
        assert list(disk.iterdir()) == []  # the partial output is gone: the space is free
