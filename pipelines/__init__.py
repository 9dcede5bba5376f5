"""Train pipelines: `progress(dataloader_iter) -> output`, TorchRec's TrainPipeline interface.

The plain loop (`plain.py`) is the oracle every other pipeline must equal.
"""
