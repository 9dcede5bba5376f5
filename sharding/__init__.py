"""Cluster model and planners: where each embedding table lives and what it costs.

Library code here takes typed dataclasses and plain iterables; it never imports Hydra,
OmegaConf, `recsys` or `pipelines` (docs/layout.md: the layers and their direction).

The public API for a TorchRec training script is `__all__` (docs/library.md); the other
names in this package may change between versions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridPlanner", "HybridShardingPlan", "check_plan_paths", "load_cluster"]


def __getattr__(name: str) -> Any:
    """The public names, imported when first used (they import TorchRec)."""
    if name in __all__:
        from sharding import api

        return getattr(api, name)
    raise AttributeError(f"module 'sharding' has no attribute '{name}'")
