"""Which code a saved result measured, and whether that code has changed since.

Each results directory holds `code.json`, written beside the result by `common.finish`: the
benchmark, the paths whose code decides its figures (`CODE`), and a digest of every file
under them. A Python file's digest is of its syntax tree without docstrings, so formatting,
comments and docstrings never make a result stale; any other file (a preset, the committed
calibration) is digested as it is. A result is stale when a file it recorded has changed or
gone; a file added under its paths is not a change to the code it measured.
`python -m benchmarks.docs_sync` reads these records for every result the docs cite.

`python -m benchmarks.fingerprint` lists every results directory with its benchmark, the
commit it was measured at and what changed since. A change that cannot move a result's
figures (a message, how a file is saved) may be accepted for it by name, with the reason
kept in its record: `python -m benchmarks.fingerprint keep=<dir>[,<dir>] files=<file>[,<file>]
"why=<reason>"`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = "code.json"

# what decides a plan and its predicted step: the planners, the cost model and its
# calibration, the presets they read
PLANNING = ("sharding", "conf/cluster", "conf/planner", "conf/model", "conf/dataset")
# what decides a training step's time and result
TRAINING = (
    "pipelines",
    "recsys/trainer",
    "recsys/models",
    "recsys/data",
    "recsys/emulation.py",
    "recsys/collectives.py",
    "recsys/train.py",
    "recsys/app/train.py",
    "recsys/app/planning.py",
    "conf/trainer",
    "conf/pipeline",
)
# per benchmark (its module's name), beside the module itself and benchmarks/common.py;
# a benchmark not named here depends on the whole product
CODE: dict[str, tuple[str, ...]] = {
    "planners": PLANNING,
    "grid_recheck": PLANNING,
    "two_d": PLANNING,
    "calibrate": PLANNING + TRAINING,
    "plan_train": PLANNING + TRAINING + ("benchmarks/netns.py",),
    "batch_split": PLANNING + TRAINING,
    "speed_aware": PLANNING + TRAINING,
    "pipeline": PLANNING + TRAINING + ("benchmarks/netns.py",),
    "dense_reduce": PLANNING + TRAINING + ("benchmarks/netns.py",),
    "scale": PLANNING + TRAINING,
    "movielens": TRAINING,
    "data": ("recsys/data",),
}
PRODUCT = ("sharding", "pipelines", "recsys", "conf")


def paths_of(benchmark: str) -> list[str]:
    """The paths whose code a benchmark's results depend on."""
    own = [f"benchmarks/{benchmark}.py", "benchmarks/common.py"]
    return [*CODE.get(benchmark, PRODUCT), *own]


def digest(path: str, data: bytes) -> str:
    """A file's digest: a Python file's syntax tree without docstrings, any other its bytes."""
    if path.endswith(".py"):
        try:
            tree = ast.parse(data)
        except SyntaxError:
            pass
        else:
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if (
                    isinstance(body, list)
                    and body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)
                ):
                    node.body = body[1:] or [ast.Pass()]
            data = ast.dump(tree).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _wanted(name: str) -> bool:
    return "__pycache__" not in name and not name.endswith((".pyc", ".md"))


def _files_now(paths: Iterable[str], repo: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for p in paths:
        root = repo / p
        files = [root] if root.is_file() else sorted(x for x in root.rglob("*") if x.is_file())
        for f in files:
            name = f.relative_to(repo).as_posix()
            if _wanted(name):
                found[name] = f
    return found


def snapshot(repo: Path = REPO) -> dict:
    """Every file any benchmark's record may name, as it is now: taken when a benchmark
    starts, so that its record is of the code it ran even if files change while it runs."""
    paths = [*PRODUCT, *(p.relative_to(repo).as_posix() for p in repo.glob("benchmarks/*.py"))]
    files = {name: f.read_bytes() for name, f in _files_now(paths, repo).items()}
    return {"commit": _head(repo), "files": files}


def record(benchmark: str, repo: Path = REPO, taken: dict | None = None) -> dict:
    """The code record (`code.json`) of a result measured from the files `taken` by
    `snapshot` when it started (default: as they are now)."""
    paths = paths_of(benchmark)
    taken = taken or snapshot(repo)
    files = {
        name: digest(name, data)
        for name, data in taken["files"].items()
        if any(name == p or name.startswith(p.rstrip("/") + "/") for p in paths)
    }
    return {"benchmark": benchmark, "paths": paths, "commit": taken["commit"], "files": files}


def record_at(benchmark: str, commit: str, repo: Path = REPO) -> dict:
    """The code record of a result as the code stood at `commit` (for results saved before
    records were kept: the commit that last wrote them)."""
    paths = paths_of(benchmark)
    listed = _git(repo, "ls-tree", "-r", "--name-only", commit, "--", *paths).split()
    files = {
        name: digest(name, _git_bytes(repo, "show", f"{commit}:{name}"))
        for name in sorted(listed)
        if _wanted(name)
    }
    return {"benchmark": benchmark, "paths": paths, "commit": commit, "files": files}


def changed(saved: dict, repo: Path = REPO) -> list[str]:
    """The recorded files that changed or are gone since the record was made."""
    out = []
    for name, old in saved.get("files", {}).items():
        f = repo / name
        if not f.is_file():
            out.append(f"{name} (gone)")
        elif digest(name, f.read_bytes()) != old:
            out.append(name)
    return out


def staleness(results_dir: Path, repo: Path = REPO) -> str | None:
    """None when a results directory's code is unchanged; else why it is stale."""
    path = results_dir / RECORD
    if not path.is_file():
        return f"no {RECORD}: the code it measured is unknown"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path.name} unreadable ({e})"
    moved = changed(saved, repo)
    if not moved:
        return None
    more = f" and {len(moved) - 3} more" if len(moved) > 3 else ""
    return f"code changed since it was measured: {', '.join(moved[:3])}{more}"


def benchmark_of(results_dir: str, benchmarks: Iterable[str] | None = None) -> str:
    """The benchmark a results directory came from: the longest benchmark module name its
    name starts with (`plan_train_emu_mixed4` -> plan_train, `movielens100k` -> movielens)."""
    names = benchmarks or [p.stem for p in (REPO / "benchmarks").glob("*.py")]
    hits = [n for n in names if results_dir == n or results_dir.startswith(n)]
    if not hits:
        raise ValueError(f"no benchmark module matches the results directory '{results_dir}'")
    return max(hits, key=len)


def _head(repo: Path) -> str | None:
    try:
        head = _git(repo, "rev-parse", "HEAD").strip()
        dirty = _git(repo, "status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # not a checkout (an installed copy): the digests still say it
    return head + ("+uncommitted" if dirty else "")


def _git(repo: Path, *args: str) -> str:
    return _git_bytes(repo, *args).decode()


def _git_bytes(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=True).stdout


def keep(results_dir: Path, files: list[str], why: str, repo: Path = REPO) -> list[str]:
    """Accept changes to `files` since a result was measured as not moving its figures:
    those files take today's digests in its record, and `kept` lists them with the reason.
    Returns the files accepted (those of `files` that had changed)."""
    path = results_dir / RECORD
    saved = json.loads(path.read_text())
    accepted = [f for f in changed(saved, repo) if f in files]
    now = record(saved["benchmark"], repo)["files"]
    digests = {**saved["files"], **{f: now[f] for f in accepted}}
    kept = [*saved.get("kept", []), {"files": accepted, "why": why, "at": _head(repo)}]
    path.write_text(json.dumps({**saved, "files": digests, "kept": kept}, indent=1) + "\n")
    return accepted


def status(repo: Path = REPO) -> list[str]:
    """One line per results directory: its benchmark, commit and whether it is fresh."""
    lines = []
    for d in sorted(p for p in (repo / "benchmarks" / "results").iterdir() if p.is_dir()):
        try:
            saved = json.loads((d / RECORD).read_text())
        except (OSError, ValueError):
            saved = {}
        commit = (saved.get("commit") or "?")[:12]
        lines.append(
            f"{d.name:34} {saved.get('benchmark', '?'):20} {commit:12} "
            f"{staleness(d, repo) or 'fresh'}"
        )
    return lines


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    if "keep" in args:
        if not args.get("why") or not args.get("files"):
            raise SystemExit("keep=<dir>[,<dir>] needs files=<file>[,<file>] and why=<the reason>")
        for name in args["keep"].split(","):
            d = REPO / "benchmarks" / "results" / name
            if not (d / RECORD).is_file():
                raise SystemExit(f"{d} has no {RECORD} (run the benchmark with save=true)")
            accepted = keep(d, args["files"].split(","), args["why"])
            print(f"{name}: kept {', '.join(accepted) or 'nothing'}; {staleness(d) or 'fresh'}")
        return 0
    print("\n".join(status()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
