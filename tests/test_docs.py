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
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FIGURE = re.compile(r"\[([^\]\[\n]+)\]\(((?:\.\./)?benchmarks/results/[^)#\s]+\.json)#([^)\s]+)\)")
TABLE = re.compile(r"<!-- rows from (benchmarks/results/\S+\.md) -->\n((?:(?:\||- ).*\n)+)")
PATH = re.compile(r"benchmarks/results/[\w*./-]*")


def _resolve(data, path: str):
    for token in path.split("."):
        if "=" in token:  # key=value, or several joined by &: the one element matching all
            conditions = [c.split("=", 1) for c in token.split("&")]
            matches = [x for x in data if all(str(x.get(k)) == v for k, v in conditions)]
            assert len(matches) == 1, f"{token}: {len(matches)} matches"
            data = matches[0]
        elif isinstance(data, list):
            data = data[int(token)]
        else:
            data = data[token]
    return data


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
    value = _resolve(json.loads((REPO / file.removeprefix("../")).read_text()), path)
    number = re.search(r"-?[\d,]*\.?\d+", text)
    assert number, f"{doc.name}: no number in [{text}]"
    shown = number.group().replace(",", "")
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    value = float(value) * (100 if "%" in text else 1)
    assert round(value, decimals) == pytest.approx(float(shown), abs=10**-decimals / 2 + 1e-9), (
        f"{doc.name} quotes [{text}] for {file}#{path}, which holds {value}"
    )


@pytest.mark.parametrize(("doc", "file", "table"), list(_tables()))
def test_a_copied_table_holds_its_results_tables_rows(doc: Path, file: str, table: str):
    source = {line.strip() for line in (REPO / file).read_text().splitlines()}
    rows = [r.strip() for r in table.strip().splitlines() if not set(r) <= set("|-: ")]
    missing = [r for r in rows if r not in source]
    assert not missing, f"{doc.name}: rows not in {file} (rerun the benchmark or copy again):" + (
        "\n".join(missing)
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
