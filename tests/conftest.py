"""Shared fixtures: compose configs with Hydra's compose API, as the app would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from recsys.config import register_configs
from recsys.train import quiet_library_noise, to_typed

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

register_configs()
quiet_library_noise()


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    return compose_config


@pytest.fixture
def typed_cfg() -> Callable:
    return lambda overrides=None: to_typed(compose_config(overrides))


def plan_with_splits(cfg):
    """Our hybrid plan for `cfg` with split tables: planned for the 1 Gbit/s link and
    without the sequence exchange's CPU cost, where splitting pays even at test-sized
    batches (on loopback the calibrated cost keeps small runs' tables whole)."""
    from dataclasses import replace

    from recsys.planning import make_plan, plan_inputs
    from sharding.calibration import load_calibration

    cal = load_calibration()
    free = replace(cal, device=replace(cal.device, sequence_s_per_lookup=0.0, sequence_s_fixed=0.0))
    return make_plan(cfg, plan_inputs(cfg, None, "veth_1gbit", free))
