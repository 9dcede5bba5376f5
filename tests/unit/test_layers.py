"""The layers and their one direction of imports, read from every module's source.

Lowest first; a module may import its own layer and the layers below, never one above, and
the packages of one layer (sharding, pipelines) not each other. Every import counts: at the
top of a module, inside a function, or under TYPE_CHECKING. And no circle among modules of
one layer either. docs/layout.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGES = ("sharding", "pipelines", "recsys", "benchmarks")


# lowest first; each entry: the packages of one layer (a module belongs to its longest match)
LAYERS = [
    ("sharding", "pipelines"),  # the libraries: plans and costs; train pipelines
    ("recsys",),  # data, models, the trainer, launching and supervising ranks
    ("recsys.app",),  # the commands, config -> plan, the user's one-line errors
    ("benchmarks",),  # measurements, on the public functions of the layers below
]


# What users type (`python -m sharding.plan`) where the command lives higher up: each of
# these holds only a docstring and `if __name__ == "__main__":` calling into recsys.app.
ENTRY_MODULES = {
    "recsys.train": "recsys.app.train",
    "recsys.evaluate": "recsys.app.train",
    "sharding.plan": "recsys.app.plan",
    "sharding.predict": "recsys.app.predict",
    "sharding.profile": "recsys.app.profile",
    "sharding.describe": "recsys.app.describe",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (a package's name when the import names one)."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.split(".")[0] in PACKAGES:
                found.add(target)
    return found


def _layer(module: str) -> tuple[int, str]:
    """(layer index, package of that layer) by the longest prefix."""
    best = (-1, "")
    for i, packages in enumerate(LAYERS):
        for p in packages:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best[1]):
                best = (i, p)
    assert best[0] >= 0, f"{module} belongs to no layer; add its package to LAYERS"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items() if m not in ENTRY_MODULES}


def test_imports_run_down_the_layers_only() -> None:
    wrong = []
    for module, targets in _graph().items():
        level, package = _layer(module)
        for target in targets:
            t_level, t_package = _layer(target)
            if t_level > level or (t_level == level and t_package != package):
                wrong.append(f"{module} -> {target}")
    assert not wrong, (
        "imports against the layers (tests/unit/test_layers.py LAYERS):\n"
        + "\n".join(sorted(wrong))
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle() -> None:
    assert _cycles(_graph()) == []


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    """The two checks above on a made-up graph: they would fail on either fault."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("sharding.cost_model")[0] < _layer("recsys.trainer.loop")[0]
    assert _layer("recsys.app.plan")[0] > _layer("recsys.launch")[0]
    assert _layer("sharding.x") == (0, "sharding") and _layer("pipelines.x") == (0, "pipelines")


def test_entry_modules_only_call_the_command() -> None:
    modules = _modules()
    for name, command in ENTRY_MODULES.items():
        tree = ast.parse(modules[name].read_text())
        doc, guard = tree.body  # a docstring and the __main__ guard, nothing else
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), name
        assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"
        imported, call = guard.body
        assert isinstance(imported, ast.ImportFrom) and imported.module == command, name
        assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call), name


def test_the_config_schema_and_the_data_commands_import_no_torch() -> None:
    """Composing or checking a config (every command does, first) loads neither torch nor
    TorchRec: the schemas live apart from the models and the trainer. Nor do the data
    commands (text files in, text or prepared arrays out): they start in a fraction of a
    second, and so does each of prepare's parse workers (also under benchmarks.data, whose
    module they import)."""
    import subprocess
    import sys

    code = (
        "import sys, recsys.config, sharding.types, pipelines.types, recsys.data.synth, "
        "recsys.data.prepare, recsys.data.remap, benchmarks.data; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchrec'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
