"""Stream 2-D arrays into .npy files whose row count is known only at the end."""

from __future__ import annotations

import struct
from pathlib import Path
from types import TracebackType

import numpy as np

_HEADER_BYTES = 128  # magic + version + length + dict, space padded: room for any shape
_MAGIC_V1 = b"\x93NUMPY\x01\x00"


def _header(dtype: np.dtype, shape: tuple[int, int]) -> bytes:
    text = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
    pad = _HEADER_BYTES - len(_MAGIC_V1) - 2 - len(text) - 1
    if pad < 0:
        raise ValueError(f"npy header for shape {shape} does not fit {_HEADER_BYTES} bytes")
    body = (text + " " * pad + "\n").encode("latin1")
    return _MAGIC_V1 + struct.pack("<H", len(body)) + body


class NpyAppender:
    """Append row blocks to `path`; `close()` writes the final shape into the header.

    The result is a standard NPY 1.0 file that `np.load` (and TorchRec's readers) read.
    """

    def __init__(self, path: str | Path, dtype: np.dtype | type, columns: int) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.columns = columns
        self.rows = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(_header(self.dtype, (0, columns)))

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype).reshape(-1, self.columns)
        self._file.write(block.tobytes())
        self.rows += block.shape[0]

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.seek(0)
        self._file.write(_header(self.dtype, (self.rows, self.columns)))
        self._file.close()

    def __enter__(self) -> NpyAppender:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
