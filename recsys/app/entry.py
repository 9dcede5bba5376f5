"""The frame every planning command shares: Hydra on the project's configs, the body under
`recsys.console.command()` (its output also in its log, a user's error as one line, Ctrl-C or
SIGTERM as one line), the libraries' known noise quieted; the body gets the typed config and
the run directory."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from recsys.app import CONF_DIR
from recsys.config import to_object
from recsys.console import command


def hydra_command(config_name: str) -> Callable[[Callable[[Any, Path], None]], Callable]:
    """`@hydra_command("plan")` on `body(typed_cfg, run_dir)` makes the command's `main`."""

    def decorate(body: Callable[[Any, Path], None]) -> Callable:
        @functools.wraps(body)  # Hydra names the job, and its log, after body's module
        def task(cfg: DictConfig) -> None:
            from recsys.app.train import quiet_library_noise

            with command():
                quiet_library_noise()
                body(to_object(cfg), Path(HydraConfig.get().runtime.output_dir))

        return hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)(task)

    return decorate
