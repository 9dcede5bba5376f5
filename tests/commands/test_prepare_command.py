"""`python -m recsys.data.prepare`: bad input is one line and exit 1; Ctrl-C leaves nothing
and exits 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_command
from support import input_file, random_rows, sigint_default, tsv

from recsys.data.synthetic_files import SynthConfig, synthesize


@pytest.mark.slow
def test_ctrl_c_during_prepare_leaves_nothing_and_exits_130(tmp_path: Path) -> None:
    src = tmp_path / "tsv"
    synthesize(SynthConfig(output=str(src), rows=400_000, scale=1000))
    out = tmp_path / "bin"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recsys.data.prepare",
            f"input={src}",
            f"output={out}",
            "workers=1",
            "chunk_mb=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".bin.partial-*/*")):  # it is writing now
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "removed the partial output" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tsv"]


@pytest.mark.parametrize(
    "content, message",
    [(b"", "the file is empty"), (b"2\t1\n", "every line is malformed")],
)
def test_the_cli_exits_non_zero_with_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    src = input_file(tmp_path, "day_0", content)
    proc = run_command(
        "recsys.data.prepare",
        f"input={src}",
        f"output={tmp_path / 'o'}",
        "skip_bad_lines=true",
        "workers=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_the_cli_refuses_overwriting_its_input_in_one_line(tmp_path: Path) -> None:
    src = input_file(tmp_path, "train.txt", tsv(*random_rows(100)))
    before = src.read_bytes()
    proc = run_command(
        "recsys.data.prepare",
        f"input={src.parent}",
        f"output={src.parent}",
        "overwrite=true",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: output '{src.parent}' is the input '{src.parent}': writing there would replace "
        f"or mix with what is read. Name an output directory outside the input, e.g. "
        f"output={src.parent}_out"
    ]
    assert src.read_bytes() == before


def test_paths_with_spaces_and_accents_work_quoted_as_docs_data_md_says(tmp_path: Path) -> None:
    """Hydra's override grammar takes unquoted values of ASCII letters, digits and a few
    signs: a path with a space or an accent is quoted inside the override (docs/data.md)."""
    where = tmp_path / "données brutes"
    bare = run_command(
        "recsys.data.synth", f"output={where}", "rows=100", f"hydra.run.dir={tmp_path / 'a'}"
    )
    assert bare.returncode != 0 and not where.exists()
    quoted = run_command(
        "recsys.data.synth", f"output='{where}'", "rows=100", f"hydra.run.dir={tmp_path / 'b'}"
    )
    assert quoted.returncode == 0, quoted.stderr[-2000:]
    out = tmp_path / "préparé"
    prepared = run_command(
        "recsys.data.prepare",
        f"input='{where}'",
        f"output='{out}'",
        f"hydra.run.dir={tmp_path / 'c'}",
    )
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert (out / "train_dense.npy").exists()
