"""Shared fixtures: compose configs with Hydra's compose API, as the app would."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import settings
from omegaconf import DictConfig

from recsys.app.train import quiet_library_noise, to_typed
from recsys.config import register_configs

# Property tests draw the same examples on every run (`make test`, CI): a red build names a
# change, not a lucky draw. HYPOTHESIS_PROFILE=explore draws new ones, to hunt for bugs.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

register_configs()
quiet_library_noise()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow (multi-process) tests first, in their order: under `make test`'s two workers
    the long ones start early and short ones fill the gaps at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    return compose_config


@pytest.fixture
def no_ranks(monkeypatch) -> None:
    """A test that fails if any rank is spawned: what it checks must stop before that."""
    from recsys import launch

    monkeypatch.setattr(launch, "spawn_ranks", lambda *a, **k: pytest.fail("ranks started"))


@pytest.fixture
def typed_cfg() -> Callable:
    return lambda overrides=None: to_typed(compose_config(overrides))


def plan_with_splits(cfg):
    """Our hybrid plan for `cfg` with split tables (`recsys.app.planning.plan_with_splits`),
    across the calibrated 1 Gbit/s link."""
    from recsys.app.planning import plan_with_splits as plan
    from sharding.calibration import load_calibration

    return plan(cfg, load_calibration(), "veth_1gbit")
