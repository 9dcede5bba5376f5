"""Small shims that let TorchRec's SemiSync and FusedSparseDist pipelines run on CPU ranks,
each still needed on TorchRec 1.9.2 / torch 2.14.1 (re-checked: without any one of them
`pipeline=semi_sync` fails on CPU ranks, and without all of them `fused_sparse_dist` does;
tests/ranks/test_train.py):
- `Tensor.record_stream` rejects a CPU stream (TorchRec records its KJTs on the streams
  that consume them);
- the pipelined forward assumes a CUDA device when it has no stream;
- 1.9's stream-synced embedding lookup asks its stream for `.device`, which
  `torch.cpu.Stream` lacks (new in 1.9: `_start_embedding_lookup_stream_synced`).
Installed only when such a pipeline is built on CPU; CUDA behaviour is unchanged.
"""

from __future__ import annotations

import torch
from torchrec.distributed.train_pipeline import runtime_forwards

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    record_stream = torch.Tensor.record_stream

    def record_stream_cpu_noop(self: torch.Tensor, stream) -> None:
        if self.device.type == "cpu":  # nothing to keep alive: CPU work is synchronous
            return None
        return record_stream(self, stream)

    torch.Tensor.record_stream = record_stream_cpu_noop  # type: ignore[method-assign]

    init = runtime_forwards.BaseForward.__init__

    def init_keeping_cpu(self, name, args, module, context, stream=None) -> None:
        init(self, name, args, module, context, stream)
        if stream is None and not torch.cuda.is_available():
            self._device = torch.device("cpu")

    runtime_forwards.BaseForward.__init__ = init_keeping_cpu  # type: ignore[method-assign]
    if not hasattr(torch.cpu.Stream, "device"):
        torch.cpu.Stream.device = property(lambda self: torch.device("cpu"))  # type: ignore[attr-defined]
    _installed = True
