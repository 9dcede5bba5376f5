"""The plain training loop as a TrainPipeline: the reference every pipeline is checked against."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline import TrainPipeline


class PlainPipeline(TrainPipeline[Any, Any]):
    """One batch at a time: fetch, copy to device, forward, backward, optimizer step.

    The model returns `(loss, output)` (TorchRec's DLRMTrain convention); `progress` returns
    `output`. In eval mode (`model.eval()`) it only runs the forward.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> None:
        super().__init__()
        self._model = model
        self._optimizer = optimizer
        self._device = device

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        batch = next(dataloader_iter).to(self._device, non_blocking=True)
        if not self._model.training:
            with torch.no_grad():
                return self._model(batch)[1]
        self._optimizer.zero_grad()
        loss, output = self._model(batch)
        loss.backward()
        self._optimizer.step()
        return output
