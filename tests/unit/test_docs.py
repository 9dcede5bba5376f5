"""The docs cannot silently go stale: every figure they quote from a benchmark's results
links to it and matches it, every table marked as copied from a results table holds that
table's rows, and every results path they name exists.

- A figure, as a link a reader can follow to its numbers:
  `[1.54x](benchmarks/results/plan_train_emu_mixed4/summary.json#rows.planner=hybrid.speedup_vs_first)`
  (the path: dot-separated keys; `key=value`, or several joined by `&`, picks the list
  element that matches):
  its first number (a `%` figure: the value x 100) must equal the value at the decimals shown.
- A table: a line `<!-- rows from benchmarks/results/<dir>/<name>.md -->` right above it;
  its header and each row must be lines of that file (a subset of its rows, unchanged).

`python -m benchmarks.docs_sync` refreshes both after a benchmark is re-run, and marks a
quoted result whose code has changed since it was measured (`benchmarks/fingerprint.py`);
the README quotes fresh results only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import fingerprint
from benchmarks.docs_sync import DOCS, FIGURE, NUMBER, REPO, TABLE, resolve, source_tables

PATH = re.compile(r"benchmarks/results/[\w*./-]*")


def _figures():
    for doc in DOCS:
        for m in FIGURE.finditer(doc.read_text()):
            yield pytest.param(doc, *m.groups(), id=f"{doc.name}:{m.group(1)}")


def _tables():
    for doc in DOCS:
        for m in TABLE.finditer(doc.read_text()):
            yield pytest.param(doc, *m.groups(), id=f"{doc.name}:{m.group(1)}")


@pytest.mark.parametrize(("doc", "text", "file", "path"), list(_figures()))
def test_a_quoted_figure_matches_its_results_file(doc: Path, text: str, file: str, path: str):
    value = resolve(json.loads((REPO / file.removeprefix("../")).read_text()), path)
    number = NUMBER.search(text)
    assert number, f"{doc.name}: no number in [{text}]"
    shown = number.group().replace(",", "")
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    value = float(value) * (100 if "%" in text else 1)
    assert round(value, decimals) == pytest.approx(float(shown), abs=10**-decimals / 2 + 1e-9), (
        f"{doc.name} quotes [{text}] for {file}#{path}, which holds {value}"
    )


@pytest.mark.parametrize(("doc", "file", "table"), list(_tables()))
def test_a_copied_table_holds_its_results_tables_rows(doc: Path, file: str, table: str):
    """Every row of the quoted table, its header included, is a line of one table of the
    results file (a file may hold several tables of one header: a row set's rows quoted
    under another's heading would otherwise pass)."""
    rows = [r.strip() for r in table.strip().splitlines() if not set(r) <= set("|-: ")]
    tables = [set(t) for t in source_tables((REPO / file).read_text())] or [set()]
    best = max(tables, key=lambda t: sum(r in t for r in rows))
    missing = [r for r in rows if r not in best]
    assert not missing, (
        f"{doc.name}: rows not in one table of {file} (rerun the benchmark or copy again):"
        + "\n".join(missing)
    )


def test_every_results_path_the_docs_name_exists() -> None:
    for doc in DOCS:
        for m in PATH.finditer(doc.read_text()):
            path = m.group().rstrip(".,)`")
            if path.endswith("<name>") or "<" in path:
                continue
            assert list(REPO.glob(path)), f"{doc.name} names {path}, which does not exist"


def test_the_docs_quote_figures_and_tables_from_results() -> None:
    """Guards the guard: the README's headline figures and tables are checked ones."""
    readme = (REPO / "README.md").read_text()
    assert len(FIGURE.findall(readme)) >= 5 and TABLE.search(readme)


def test_docs_sync_refreshes_a_stale_row_and_figure_and_leaves_what_it_cannot_match(tmp_path):
    from benchmarks.docs_sync import sync

    results = tmp_path / "benchmarks/results/x"
    results.mkdir(parents=True)
    (results / "code.json").write_text('{"files": {}}')  # fresh: no file it measured changed
    (results / "x.md").write_text(
        "| cluster | planner | ms |\n|---|---|---|\n| c_1 | hybrid | 9.50 |\n| c_1 | tr | 12.00 |\n"
    )
    (results / "summary.json").write_text(json.dumps({"rows": [{"p": "hybrid", "x": 1.2634}]}))
    doc = tmp_path / "README.md"
    doc.write_text(
        "<!-- rows from benchmarks/results/x/x.md -->\n"
        "| cluster | planner | ms |\n|---|---|---|\n"
        "| c_1 | hybrid | 10.07 |\n| c_2 | gone | 1.00 |\n"
        "\nHybrid is [1.31x](benchmarks/results/x/summary.json#rows.p=hybrid.x) faster, "
        "[5%](benchmarks/results/x/summary.json#rows.p=none.x).\n"
    )
    log: list[str] = []
    text = sync(doc, log, repo=tmp_path)
    assert "| c_1 | hybrid | 9.50 |" in text and "10.07" not in text
    assert "| c_2 | gone | 1.00 |" in text  # no source row with its labels: left alone, listed
    assert "[1.26x](benchmarks/results/x/summary.json#rows.p=hybrid.x)" in text
    assert "[5%]" in text
    assert sum("NOT MATCHED" in line for line in log) == 2 and len(log) == 4


def test_docs_sync_takes_each_quoted_table_from_its_own_row_set(tmp_path):
    """A results file with two tables of one header and row names (a benchmark's main rows
    and its multi-hot rows): each stale quote is refreshed from the table it copies, the
    one closest in value, not from the first that names its rows."""
    from benchmarks.docs_sync import sync

    results = tmp_path / "benchmarks/results/x"
    results.mkdir(parents=True)
    (results / "code.json").write_text('{"files": {}}')
    head = "| pipeline | samples/s | MB |\n|---|---|---|\n"
    (results / "x.md").write_text(
        head
        + "| plain | 30,818 | 468.0 |\n| nested4 | 52,253 | 467.9 |\n\nMulti-hot:\n\n"
        + head
        + "| plain | 18,274 | 657.3 |\n| nested4 | 25,081 | 657.0 |\n"
    )
    marker = "<!-- rows from benchmarks/results/x/x.md -->\n"
    doc = tmp_path / "README.md"
    doc.write_text(
        marker
        + head
        + "| plain | 34,503 | 467.9 |\n| nested4 | 56,276 | 467.8 |\n\n"
        + marker
        + head
        + "| plain | 22,459 | 657.0 |\n| nested4 | 30,645 | 656.9 |\n"
    )
    (results / "none.md").write_text("no table here\n")
    doc.write_text(
        doc.read_text()
        + "\n<!-- rows from benchmarks/results/x/none.md -->\n"
        + head
        + "| plain | 1 | 2 |\n"
    )
    log: list[str] = []
    text = sync(doc, log, repo=tmp_path)
    main, multi, none = text.split("\n\n")
    assert "| plain | 1 | 2 |" in none and any("NOT MATCHED" in line for line in log)
    assert "| plain | 30,818 | 468.0 |" in main and "| nested4 | 52,253 | 467.9 |" in main
    assert "| plain | 18,274 | 657.3 |" in multi and "| nested4 | 25,081 | 657.0 |" in multi


def test_docs_sync_marks_a_result_whose_code_changed_and_unmarks_it_once_fresh(tmp_path):
    from benchmarks.docs_sync import STALE, sync

    (tmp_path / "sharding").mkdir()
    (tmp_path / "sharding/hybrid.py").write_text("A = 1\n")
    results = tmp_path / "benchmarks/results/x"
    results.mkdir(parents=True)
    (results / "s.json").write_text(json.dumps({"x": 1.5}))
    (results / "x.md").write_text("| a | ms |\n|---|---|\n| h | 2.0 |\n")
    digest = fingerprint.digest("sharding/hybrid.py", b"A = 1\n")
    (results / "code.json").write_text(json.dumps({"files": {"sharding/hybrid.py": digest}}))
    quote = (
        "<!-- rows from benchmarks/results/x/x.md -->\n| a | ms |\n|---|---|\n| h | 2.0 |\n\n"
        "It is [1.5x](../benchmarks/results/x/s.json#x) faster.\n"
    )
    (tmp_path / "docs").mkdir()
    doc, readme = tmp_path / "docs/d.md", tmp_path / "README.md"
    doc.write_text(quote)
    readme.write_text(quote.replace("../", ""))
    log: list[str] = []
    assert sync(doc, log, repo=tmp_path) == quote and not log  # fresh: nothing to say

    (tmp_path / "sharding/hybrid.py").write_text("A = 2\n")
    marked = sync(doc, log, repo=tmp_path)
    assert f"x.md --> {STALE}\n| a |" in marked and f"s.json#x){STALE} faster" in marked
    assert len(log) == 2 and all("marked stale" in line and "hybrid.py" in line for line in log)
    doc.write_text(marked)
    log.clear()
    assert sync(doc, log, repo=tmp_path) == marked and not log  # marked: nothing more to do
    sync(readme, log, repo=tmp_path)
    assert len(log) == 2 and all("STALE" in line and "README" in line for line in log)

    (tmp_path / "sharding/hybrid.py").write_text("A = 1\n")  # fresh again: the marks go
    log.clear()
    assert sync(doc, log, repo=tmp_path) == quote and len(log) == 2


def test_the_readme_cites_fresh_results_and_the_docs_mark_every_stale_one():
    """What `python -m benchmarks.docs_sync check=true` asks: nothing left to refresh."""
    from benchmarks.docs_sync import sync

    log: list[str] = []
    for doc in DOCS:
        sync(doc, log)
    assert not log, "run python -m benchmarks.docs_sync (README: rerun the benchmarks):\n" + (
        "\n".join(log)
    )
