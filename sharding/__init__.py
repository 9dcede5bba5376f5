"""Cluster model and planners: where each embedding table lives and what it costs.

Library code here takes typed dataclasses and plain iterables; it never imports Hydra,
OmegaConf, `recsys` or `pipelines` (docs/layout.md: the layers and their direction).

The public API for a TorchRec training script is `__all__` here (from `sharding.api`, imported
when first named, so that `import sharding` stays free of torch; docs/library.md); the other
modules may change between versions.
"""

__all__ = [
    "HybridPlanner",
    "HybridShardingPlan",
    "ShareWeightedLoss",
    "check_plan_paths",
    "load_cluster",
]


def __getattr__(name: str):  # `from sharding import HybridPlanner`: sharding.api on first use
    if name in __all__:
        from sharding import api

        return getattr(api, name)
    raise AttributeError(f"module 'sharding' has no attribute '{name}'")
