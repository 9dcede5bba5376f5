"""Copy fresh benchmark results into the docs: `python -m benchmarks.docs_sync`.

The docs quote results two ways (tests/unit/test_docs.py checks both):
- a table under `<!-- rows from benchmarks/results/<dir>/<name>.md -->`: the rows of one of
  that file's tables (`source_tables`; a file may hold several with the same header and row
  names, e.g. a benchmark's main rows and its multi-hot rows); each row that is no longer
  a line of it is replaced by its row with the same leading label cells (the cells before
  the first number, e.g. `| hetero_64 | hybrid |`), from the table whose rows are the
  closest in value to the quoted ones (`_source_of`);
- a figure linked to a results JSON, `[1.54x](benchmarks/results/.../summary.json#rows.0.x)`:
  its number is rewritten to the value at the decimals shown.

A quoted result whose code has changed since it was measured (`benchmarks/fingerprint.py`,
the results directory's `code.json`) is marked `<sup>stale</sup>` after the figure or on the
table's marker line, and the mark is dropped once the result is fresh again; the README
cites fresh results only, so a stale one there is an error until the benchmark is re-run.

Every change is printed as `doc: old -> new`, so the prose around it can be read again: a
sentence such as "all on two equal H100 nodes" is not a number and is left to the writer.
Rows or figures it cannot match are listed and left alone. `check=true` changes nothing
and exits 1 if anything is out of date.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks import fingerprint

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FIGURE = re.compile(r"\[([^\]\[\n]+)\]\(((?:\.\./)?benchmarks/results/[^)#\s]+\.json)#([^)\s]+)\)")
TABLE = re.compile(
    r"<!-- rows from (benchmarks/results/\S+\.md) -->(?: <sup>stale</sup>)?\n((?:(?:\||- ).*\n)+)"
)
# after a quoted figure, or after a copied table's marker line: the result's code has
# changed since it was measured (benchmarks/fingerprint.py)
STALE = "<sup>stale</sup>"
NUMBER = re.compile(r"-?[\d,]*\.?\d+")
NUMERIC_CELL = re.compile(r"^[<>~]?-?[\d,]*\.?\d+\s*(x|%|s|ms|MB|GB)?$")


def resolve(data, path: str):
    """The value at a dot-separated path; `key=value` (several joined by `&`) picks the one
    list element matching all."""
    for token in path.split("."):
        if "=" in token:
            conditions = [c.split("=", 1) for c in token.split("&")]
            matches = [x for x in data if all(str(x.get(k)) == v for k, v in conditions)]
            if len(matches) != 1:
                raise KeyError(f"{token}: {len(matches)} matches")
            data = matches[0]
        elif isinstance(data, list):
            data = data[int(token)]
        else:
            data = data[token]
    return data


def shown(text: str, value: float) -> str | None:
    """`text` with its first number replaced by `value` at the decimals it shows, or None
    when it has no number. A `%` figure shows the value x 100."""
    m = NUMBER.search(text)
    if not m:
        return None
    old = m.group()
    decimals = len(old.split(".")[1]) if "." in old else 0
    value *= 100 if "%" in text else 1
    new = f"{value:,.{decimals}f}" if "," in old else f"{value:.{decimals}f}"
    return text[: m.start()] + new + text[m.end() :]


def _label(row: str) -> tuple[str, ...]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    label = []
    for cell in cells:
        if NUMERIC_CELL.match(cell):
            break
        label.append(cell)
    return (len(cells), *label)


def source_tables(text: str) -> list[list[str]]:
    """A results file's tables, each its lines (header, separator, rows), stripped."""
    tables: list[list[str]] = []
    previous = False
    for line in (x.strip() for x in text.splitlines()):
        if line.startswith("|"):
            if not previous:
                tables.append([])
            tables[-1].append(line)
        previous = line.startswith("|")
    return tables


def _numbers(row: str) -> list[float]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return [
        float(NUMBER.search(c).group().replace(",", "")) for c in cells if NUMERIC_CELL.match(c)
    ]


def _source_of(table: str, tables: list[list[str]]) -> list[str]:
    """The results table a quoted one copies: among those with its header, one that holds
    every quoted row as it is, else the one whose rows of the same labels are closest in
    value (a fresh run moves every number a little; another row set, most of them a lot)."""
    rows = [r.strip() for r in table.strip().splitlines()]
    same = [t for t in tables if t and rows and t[0] == rows[0]] or tables
    body = [r for r in rows[1:] if not set(r) <= set("|-: ")]

    def distance(t: list[str]) -> tuple[int, float]:
        by_label = {_label(x): x for x in t}
        far = 0.0
        for row in body:
            match = by_label.get(_label(row))
            if match is None:
                far += 1.0
                continue
            pairs = zip(_numbers(row), _numbers(match), strict=False)
            far += sum(abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in pairs)
        return -sum(r in t for r in body), far

    return min(same, key=distance) if same else []


def _sync_table(doc: str, source: Path, table: str, log: list[str]) -> str:
    lines = _source_of(table, source_tables(source.read_text()))
    present = set(lines)
    by_label: dict[tuple, list[str]] = {}
    for line in lines:
        if line.startswith("|"):
            by_label.setdefault(_label(line), []).append(line)
    out = []
    for row in table.splitlines():
        if row.strip() in present or set(row) <= set("|-: "):
            out.append(row)
            continue
        candidates = by_label.get(_label(row), [])
        if len(candidates) == 1:
            log.append(f"{doc}: {row.strip()}\n    -> {candidates[0]}")
            out.append(candidates[0])
        else:
            log.append(f"{doc}: NOT MATCHED ({len(candidates)} candidates) {row.strip()}")
            out.append(row)
    return "\n".join(out) + "\n"


def sync(doc: Path, log: list[str], repo: Path = REPO) -> str:
    """The doc's text with its copied tables and linked figures refreshed (paths in it are
    relative to `repo`), and each citation of a result whose code has changed since it was
    measured marked `STALE` (the mark dropped once it is fresh again); each change, each
    quote it cannot match and each stale result the README cites is appended to `log`."""
    name = doc.relative_to(repo).as_posix()
    readme = name == "README.md"
    known: dict[Path, str | None] = {}

    def stale(file: str, marked: bool) -> bool:
        where = (repo / file.removeprefix("../")).parent
        if where not in known:
            known[where] = fingerprint.staleness(where, repo)
        why, short = known[where], where.relative_to(repo).as_posix()
        if why and readme:
            log.append(f"{name}: STALE {short} ({why}): the README cites fresh results only")
        elif why and not marked:
            log.append(f"{name}: marked stale: {short} ({why})")
        elif marked and not why:
            log.append(f"{name}: no longer stale: {short}")
        return why is not None

    def table(m: re.Match) -> str:
        file, rows = m.groups()
        mark = f" {STALE}" if stale(file, STALE in m.group(0).split("\n", 1)[0]) else ""
        return f"<!-- rows from {file} -->{mark}\n" + _sync_table(name, repo / file, rows, log)

    def figure(m: re.Match) -> str:
        label, file, path = m.groups()
        mark = STALE if stale(file, m.group(0).endswith(STALE)) else ""
        try:
            value = float(resolve(json.loads((repo / file.removeprefix("../")).read_text()), path))
        except (KeyError, IndexError, ValueError, TypeError, FileNotFoundError) as e:
            log.append(f"{name}: NOT MATCHED [{label}]({file}#{path}): {e}")
            return f"[{label}]({file}#{path}){mark}"
        new = shown(label, value)
        if new is not None and new != label:
            log.append(f"{name}: [{label}] -> [{new}]  ({file}#{path})")
            label = new
        return f"[{label}]({file}#{path}){mark}"

    text = TABLE.sub(table, doc.read_text())
    return re.compile(FIGURE.pattern + f"(?:{re.escape(STALE)})?").sub(figure, text)


def main(argv: list[str]) -> int:
    check = "check=true" in argv
    log: list[str] = []
    for doc in DOCS:
        new = sync(doc, log)
        if not check and new != doc.read_text():
            doc.write_text(new)
    print("\n".join(log) if log else "docs match their results")
    return 1 if check and log else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
