"""Train pipelines: `progress(dataloader_iter) -> output`, TorchRec's TrainPipeline interface.

The plain loop (`plain.py`) is the oracle every other pipeline must equal. The public API for a
TorchRec training script is `__all__` here (imported when first named; docs/library.md); the
other modules may change between versions.
"""

__all__ = ["NestedPipeline"]


def __getattr__(name: str):  # `from pipelines import NestedPipeline`: on first use
    if name in __all__:
        from pipelines import nested

        return getattr(nested, name)
    raise AttributeError(f"module 'pipelines' has no attribute '{name}'")
