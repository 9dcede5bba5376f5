"""Results that know their code (`benchmarks/fingerprint.py`): a result is stale once a file
of the code it measured changes, never for formatting, comments or docstrings, and a change
accepted by name (`keep`) is recorded with its reason."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import fingerprint
from benchmarks.fingerprint import RECORD, digest


def test_a_digest_ignores_layout_comments_and_docstrings_but_not_code():
    base = digest("m.py", b'def f(x):\n    """Doc."""\n    return x + 1\n')
    assert digest("m.py", b"def f(x):  # comment\n    return (x\n            + 1)\n") == base
    assert digest("m.py", b'def f(x):\n    """Other doc."""\n    return x + 2\n') != base
    assert digest("m.py", b"def f(x):\n    return x + 1  \n") == base
    assert digest("c.yaml", b"a: 1\n") != digest("c.yaml", b"a: 1 # note\n")  # not Python


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "sharding").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "sharding/hybrid.py").write_text("def plan():\n    return 1\n")
    (tmp_path / "sharding/cal.json").write_text('{"rate": 1}\n')
    (tmp_path / "benchmarks/planners.py").write_text("RUNS = 3\n")
    (tmp_path / "benchmarks/common.py").write_text("X = 1\n")
    results = tmp_path / "benchmarks/results/planners"
    results.mkdir(parents=True)
    saved = fingerprint.record("planners", tmp_path)
    (results / RECORD).write_text(json.dumps(saved))
    return results


def test_a_result_is_stale_once_a_file_it_measured_changes_or_goes(tmp_path):
    results = _repo(tmp_path)
    saved = json.loads((results / RECORD).read_text())
    assert set(saved["files"]) == {
        "sharding/hybrid.py",
        "sharding/cal.json",
        "benchmarks/planners.py",
        "benchmarks/common.py",
    }
    assert fingerprint.staleness(results, tmp_path) is None
    (tmp_path / "sharding/new.py").write_text("Y = 2\n")  # a new file changes no old code
    (tmp_path / "sharding/hybrid.py").write_text('"""Docs."""\ndef plan():  # hm\n    return 1\n')
    assert fingerprint.staleness(results, tmp_path) is None
    (tmp_path / "sharding/hybrid.py").write_text("def plan():\n    return 2\n")
    assert "sharding/hybrid.py" in fingerprint.staleness(results, tmp_path)
    (tmp_path / "sharding/cal.json").unlink()
    assert set(fingerprint.changed(json.loads((results / RECORD).read_text()), tmp_path)) == {
        "sharding/hybrid.py",
        "sharding/cal.json (gone)",
    }
    (results / RECORD).unlink()
    assert "unknown" in fingerprint.staleness(results, tmp_path)


def test_keep_accepts_only_the_files_named_and_records_why(tmp_path):
    results = _repo(tmp_path)
    (tmp_path / "benchmarks/common.py").write_text("X = 2\n")
    (tmp_path / "sharding/hybrid.py").write_text("def plan():\n    return 2\n")
    accepted = fingerprint.keep(results, ["benchmarks/common.py"], "how it saves", tmp_path)
    assert accepted == ["benchmarks/common.py"]
    why = fingerprint.staleness(results, tmp_path)
    assert why and "sharding/hybrid.py" in why and "common" not in why
    kept = json.loads((results / RECORD).read_text())["kept"]
    assert kept[0]["files"] == ["benchmarks/common.py"] and kept[0]["why"] == "how it saves"


def test_a_record_at_a_commit_digests_the_files_as_they_were(tmp_path):
    import subprocess

    _repo(tmp_path)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (tmp_path / "sharding/hybrid.py").write_text("def plan():\n    return 2\n")
    old = fingerprint.record_at("planners", head.strip(), tmp_path)
    assert fingerprint.changed(old, tmp_path) == ["sharding/hybrid.py"]
    assert fingerprint.record("planners", tmp_path)["commit"].endswith("+uncommitted")


def test_a_results_directory_names_its_benchmark():
    assert fingerprint.benchmark_of("plan_train_emu_mixed4") == "plan_train"
    assert fingerprint.benchmark_of("movielens100k") == "movielens"
    assert fingerprint.benchmark_of("planners_slow_mixed") == "planners"


def test_every_published_result_records_its_code():
    missing = [
        d.name
        for d in (fingerprint.REPO / "benchmarks/results").iterdir()
        if d.is_dir() and not (d / RECORD).is_file()
    ]
    assert not missing, f"results without {RECORD}: {missing}"
