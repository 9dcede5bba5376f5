"""The console scripts an install puts on the PATH (pyproject.toml's `[project.scripts]`): each
runs its command as `python -m <module>` does from a checkout, e.g. `recsys-train ...` as
`python -m recsys.train ...` (docs/library.md)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def _command(module: str, function: str = "main", **kwargs: object) -> Callable[[], None]:
    """The script calling `module.function(**kwargs)`, imported only when it runs."""

    def run() -> None:
        getattr(importlib.import_module(module), function)(**kwargs)

    run.__qualname__ = run.__name__ = f"{module}.{function}"
    return run


# recsys.train and recsys.evaluate: their ranks start from the stack this process imported
train = _command("recsys.app.train", "cli", serve_forks=True)
evaluate = _command("recsys.app.train", "evaluate_cli", serve_forks=True)
plan = _command("recsys.app.plan")
predict = _command("recsys.app.predict")
profile = _command("recsys.app.profile")
describe = _command("recsys.app.describe")
export = _command("recsys.export")
score = _command("recsys.export", "score_main")
synth = _command("recsys.data.synth")
prepare = _command("recsys.data.prepare")
remap = _command("recsys.data.remap")
tabular = _command("recsys.data.tabular")
movielens = _command("recsys.data.movielens")
