"""A GGUF file's header read straight from a memory map, checked before anything is loaded.

Layout (little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)::

    "GGUF" | u32 version | u64 tensor count | u64 metadata count
    metadata:     count x (string key | u32 value type | value)
    tensor table: count x (string name | u32 n_dims | n_dims x u64 dims | u32 ggml type | u64 offset)
    padding to ``general.alignment`` (32)
    tensor data:  each tensor at data_start + offset          (string = u64 length | utf-8 bytes)

We parse it ourselves with ``struct`` over ``mmap``: the ``gguf`` package's reader builds a
numpy record per array element and spends seconds on a 49k-token vocabulary, while here the
whole header of the default model reads in a fraction of that. Every length and offset is
checked against the file's size, so a truncated or corrupt file fails here with
``ModelLoadError`` naming what is wrong, before any memory is spent on weights.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp writes v3
DEFAULT_ALIGNMENT = 32

# metadata value types: fixed-size scalars (struct format), 8 = string, 9 = array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


def ggml_type_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from the ``gguf`` package."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: where its bytes are and how they are stored."""

    name: str
    shape: tuple[int, ...]  # GGUF order, innermost first: a linear's (in_features, out_features)
    type_id: int  # ggml type id
    type_name: str  # "Q4_0", "F32", ...
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """The header (metadata, tensor table) of one GGUF file and a read-only map of its bytes.

    Raises ``ModelLoadError`` from the constructor on a file that is not GGUF, of an unknown
    version, truncated anywhere (header or tensor data), or holding a tensor of a type id
    this ``gguf`` package does not know.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.file_size = f.seek(0, 2)
                if self.file_size < 24:
                    raise ModelLoadError(f"{self.path}: truncated GGUF file ({self.file_size} bytes, "
                                         "shorter than its 24-byte header)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"cannot open GGUF file {self.path}: {exc}") from exc
        try:
            self._parse()
        except ModelLoadError:
            self.close()
            raise
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
            self.close()
            raise ModelLoadError(f"{self.path}: truncated or corrupt GGUF file (in its header): {exc}") from exc

    # ---- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        magic = self._map[:4]
        if magic != MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
        self.version, num_tensors, num_kv = struct.unpack_from("<IQQ", self._map, 4)
        if self.version not in VERSIONS:
            raise ModelLoadError(f"{self.path}: GGUF version {self.version} is not supported "
                                 f"(supported: {', '.join(map(str, VERSIONS))})")
        # NOTE: every entry takes at least 8 bytes, so larger counts are corruption, not size
        if num_tensors > self.file_size // 8 or num_kv > self.file_size // 8:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header ({num_tensors} tensors, "
                                 f"{num_kv} metadata entries in {self.file_size} bytes)")
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key, pos = self._string(pos)
            (value_type,) = struct.unpack_from("<I", self._map, pos)
            self.metadata[key], pos = self._value(pos + 4, value_type, key)
        table, pos = self._tensor_table(pos, num_tensors)
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment < 1:
            raise ModelLoadError(f"{self.path}: general.alignment must be positive, got {alignment}")
        self.data_start = -(-pos // alignment) * alignment
        self.tensors = self._tensor_infos(table)

    def _check(self, end: int, what: str) -> None:
        if end > self.file_size:
            raise ModelLoadError(f"{self.path}: truncated GGUF file: {what} ends at byte {end}, "
                                 f"the file has {self.file_size}")

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + length
        self._check(end, "a metadata string")
        return self._map[pos + 8:end].decode("utf-8"), end

    def _value(self, pos: int, value_type: int, key: str) -> tuple[Any, int]:
        if value_type in _SCALAR:
            fmt = "<" + _SCALAR[value_type]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if value_type == _STRING:
            return self._string(pos)
        if value_type != _ARRAY:
            raise ModelLoadError(f"{self.path}: metadata {key!r} has unknown value type {value_type}")
        element_type, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        if element_type in _NUMPY:  # numbers: one numpy view, copied out of the map
            dtype = np.dtype(_NUMPY[element_type]).newbyteorder("<")
            end = pos + count * dtype.itemsize
            self._check(end, f"metadata array {key!r}")
            return np.frombuffer(self._map, dtype, count, pos).copy(), end
        if element_type != _STRING:
            raise ModelLoadError(f"{self.path}: metadata {key!r} is an array of unsupported type {element_type}")
        if count > self.file_size // 8:
            raise ModelLoadError(f"{self.path}: truncated or corrupt GGUF file: metadata {key!r} claims {count} "
                                 f"strings, more than its {self.file_size} bytes hold")
        values = []
        for _ in range(count):
            value, pos = self._string(pos)
            values.append(value)
        return values, pos

    def _tensor_table(self, pos: int, count: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
        table = []
        for _ in range(count):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", self._map, pos)
            if not 1 <= n_dims <= 4:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (ggml allows 1-4)")
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", self._map, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, tuple(int(d) for d in dims), int(type_id), int(offset)))
        return table, pos

    def _tensor_infos(self, table: list[tuple[str, tuple[int, ...], int, int]]) -> dict[str, TensorInfo]:
        sizes = ggml_type_sizes()
        infos: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in table:
            if type_id not in sizes:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}")
            type_name, block, block_bytes = sizes[type_id]
            if shape[0] % block:
                raise ModelLoadError(f"{self.path}: tensor {name!r} ({type_name}) has rows of {shape[0]} "
                                     f"elements, not a multiple of its block of {block}")
            info = TensorInfo(name, shape, type_id, type_name, self.data_start + offset, 0)
            nbytes = info.num_elements // block * block_bytes
            info = TensorInfo(name, shape, type_id, type_name, self.data_start + offset, nbytes)
            self._check(info.offset + nbytes, f"tensor {name!r} ({type_name} {list(shape)})")
            infos[name] = info
        return infos

    # ---- access ------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: no general.architecture in the metadata")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} missing")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, uint8 ``[nbytes]``: a read-only view of the map (no copy)."""
        info = self.tensor(name)
        return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)

    def dense(self, name: str) -> np.ndarray:  # float32, GGUF's shape reversed (torch order)
        """The tensor dequantized (``gguf``'s dequantization), a copy of its own."""
        import gguf

        info = self.tensor(name)
        raw = self.raw(name).reshape(info.num_elements // info.shape[0], -1)
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.type_id))
        # NOTE: a copy (F32 is a view of the read-only map); numpy's result is ours otherwise
        out = np.array(values, dtype=np.float32, copy=info.type_name == "F32")
        self.release(name)
        return out.reshape(tuple(reversed(info.shape)))

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident set once it has been read
        (they are clean file pages: a later read maps them in again). Loading then holds
        one tensor of the file at a time, not the whole file beside the repacked weights."""
        info = self.tensor(name)
        start = info.offset - info.offset % mmap.PAGESIZE
        if info.nbytes and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def prefetch(self) -> None:
        """Ask the kernel to read the tensor data into the page cache in the background
        (``POSIX_FADV_WILLNEED``; it returns at once), so that a load of a file not read
        before overlaps its disk reads with the work before each tensor is needed."""
        if not hasattr(os, "posix_fadvise") or self.file_size <= self.data_start:
            return
        with contextlib.suppress(OSError), open(self.path, "rb") as f:  # NOTE: only a hint
            os.posix_fadvise(f.fileno(), self.data_start, self.file_size - self.data_start, os.POSIX_FADV_WILLNEED)

    def weights_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def close(self) -> None:
        """Unmap the file. Views returned by ``raw`` must be gone (``BufferError`` otherwise)."""
        with contextlib.suppress(BufferError):  # a view still lives: the map closes when it is collected
            self._map.close()
