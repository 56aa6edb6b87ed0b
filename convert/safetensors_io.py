"""Safetensors files read and written one tensor (or one layer of a stacked tensor) at a time.

Each tensor is read through a map of its own bytes, dropped with the array: pages of a map that
has been read stay in the process's resident set until it is unmapped, so one map of a whole
checkpoint would count the file once more in RSS, and reading into a fresh array would copy it. The format: 8 bytes (little-endian
u64) giving the header's length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [a, b]}}
(offsets into the data that follows), then the data; the header may be padded with spaces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os

import ml_dtypes
import numpy as np

from lookm_jax.convert.tables import CheckpointError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header's length
_CHUNK = 1 << 30  # bytes per read/write call (Linux moves at most ~2 GiB per call)
_BLOCK = 4 << 20  # bytes of a strided or cast tensor made contiguous at once when written


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file, read on demand (`read`), or one entry of its leading axis (`layer`)."""

    path: str
    offset: int  # of its first byte in the file
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def layer(self, index: int) -> "FileTensor":
        """Entry `index` of the leading axis (a stacked tensor's layer) [*shape[1:]]."""
        sub = FileTensor(self.path, self.offset, self.dtype, self.shape[1:])
        return dataclasses.replace(sub, offset=self.offset + index * sub.nbytes)

    def read(self) -> np.ndarray:
        """The tensor, read-only, over a map of its own bytes in the file: no copy is made, and the
        map (its pages in this process's RSS) goes when the array is dropped."""
        if self.nbytes == 0:
            return np.empty(self.shape, self.dtype)
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as f:  # the map outlives the file object
            view = mmap.mmap(f.fileno(), self.offset + self.nbytes - start, offset=start,
                             flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        return np.frombuffer(view, self.dtype, math.prod(self.shape), self.offset - start).reshape(self.shape)


def _corrupt(path: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: corrupt or unreadable safetensors shard ({why})")


def _header(path: str) -> tuple[int, int, object]:
    """-> (file size, header length, the header's JSON)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            fits = size >= 8 and length <= min(size - 8, _MAX_HEADER)
            header = json.loads(f.read(length)) if fits else None
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _corrupt(path, str(err)) from None
    if not fits:
        raise _corrupt(path, f"header of {length} bytes in a file of {size}")
    return size, length, header


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: str) -> dict[str, FileTensor]:
    """The tensors of a safetensors file by name, checked against the file's size; nothing else is read."""
    size, length, header = _header(path)
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        fields = entry if isinstance(entry, dict) else {}
        shape, offsets = fields.get("shape"), fields.get("data_offsets")
        if (fields.get("dtype") not in DTYPES or not isinstance(shape, list) or not all(map(_is_count, shape))
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))):
            raise _corrupt(path, f"tensor {name}: entry {entry!r:.100} is not a dtype (one of {', '.join(DTYPES)}), "
                                 "a shape and data_offsets")
        tensor = FileTensor(path, 8 + length + offsets[0], np.dtype(DTYPES[fields["dtype"]]), tuple(shape))
        if offsets[1] - offsets[0] != tensor.nbytes or tensor.offset + tensor.nbytes > size:
            raise _corrupt(path, f"tensor {name}'s bytes {offsets} do not fit its shape {tuple(shape)} or the file")
        tensors[name] = tensor
    return tensors


class StreamWriter:
    """A safetensors file written piece by piece: `add` gives each tensor its place (in the order
    added), `write` fills it (whole, or one layer of a stacked tensor), `close` writes the header.

    The header's room is reserved up front from the names the file will hold (`names`), so the
    data never moves; `close` refuses (RuntimeError) a tensor not wholly written.
    """

    def __init__(self, path: str, names: list[str]):
        self.path = path
        self._room = -(-sum(len(n) + 256 for n in names) // 8) * 8  # a bound on each entry's JSON, 8-aligned
        self._file = open(path, "wb")
        self._tensors: dict[str, FileTensor] = {}
        self._written: dict[str, int] = {}
        self._end = 8 + self._room

    def add(self, name: str, dtype, shape: tuple[int, ...]) -> None:
        if np.dtype(dtype) not in CODES:
            raise CheckpointError(f"tensor {name}: dtype {np.dtype(dtype)} cannot be stored in safetensors")
        tensor = FileTensor(self.path, self._end, np.dtype(dtype), tuple(int(d) for d in shape))
        self._tensors[name], self._written[name] = tensor, 0
        self._end += tensor.nbytes

    def write(self, name: str, array: np.ndarray, index: int | None = None) -> None:
        """`array` (cast to the tensor's dtype) as tensor `name`, or as entry `index` of its leading axis."""
        tensor = self._tensors[name]
        target = tensor if index is None else tensor.layer(index)
        if tuple(array.shape) != target.shape:
            raise ValueError(f"{name}[{index}]: shape {array.shape}, the file holds {target.shape}")
        array = np.atleast_1d(array)
        row_bytes = target.nbytes // max(len(array), 1)
        rows = max(1, _BLOCK // max(row_bytes, 1))
        for first in range(0, len(array), rows):  # a cast or transposed view is made contiguous block by block
            block = np.ascontiguousarray(array[first:first + rows], dtype=tensor.dtype)
            data = memoryview(block.reshape(-1).view(np.uint8))
            for start in range(0, len(data), _CHUNK):
                os.pwrite(self._file.fileno(), data[start:start + _CHUNK], target.offset + first * row_bytes + start)
            del block, data  # before the next block is made
        self._written[name] += target.nbytes

    def close(self) -> None:
        unwritten = [n for n, t in self._tensors.items() if self._written[n] != t.nbytes]
        if unwritten:
            raise RuntimeError(f"{self.path}: tensors not wholly written: {unwritten[:3]}")
        header = {name: {"dtype": CODES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [t.offset - 8 - self._room, t.offset - 8 - self._room + t.nbytes]}
                  for name, t in self._tensors.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self._room:
            raise RuntimeError(f"{self.path}: header of {len(text)} bytes exceeds the {self._room} reserved")
        self._file.truncate(self._end)
        os.pwrite(self._file.fileno(), self._room.to_bytes(8, "little") + text.ljust(self._room), 0)
        self._file.close()

    def abort(self) -> None:
        self._file.close()
