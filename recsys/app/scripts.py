"""The console scripts an install puts on the PATH (pyproject.toml's `[project.scripts]`): each
runs its command as `python -m <module>` does from a checkout, e.g. `recsys-train ...` as
`python -m recsys.train ...` (docs/library.md)."""

from __future__ import annotations


def train() -> None:
    from recsys.app.train import cli

    cli(serve_forks=True)  # its ranks start from the stack this process imported


def evaluate() -> None:
    from recsys.app.train import evaluate_cli

    evaluate_cli(serve_forks=True)


def plan() -> None:
    from recsys.app.plan import main

    main()


def predict() -> None:
    from recsys.app.predict import main

    main()


def profile() -> None:
    from recsys.app.profile import main

    main()


def describe() -> None:
    from recsys.app.describe import main

    main()


def export() -> None:
    from recsys.export import main

    main()


def score() -> None:
    from recsys.export import score_main

    score_main()


def synth() -> None:
    from recsys.data.synth import main

    main()


def prepare() -> None:
    from recsys.data.prepare import main

    main()


def remap() -> None:
    from recsys.data.remap import main

    main()


def tabular() -> None:
    from recsys.data.tabular import main

    main()


def movielens() -> None:
    from recsys.data.movielens import main

    main()
