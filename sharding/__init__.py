"""Cluster model and planners: where each embedding table lives and what it costs.

Library code here takes typed dataclasses and plain iterables; it never imports Hydra,
OmegaConf, `recsys` or `pipelines` (docs/layout.md: the layers and their direction).

The public API for a TorchRec training script is `sharding.api` (its `__all__`;
docs/library.md); the other modules may change between versions.
"""
