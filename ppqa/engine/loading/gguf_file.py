"""A GGUF file's metadata and tensor table, read in one pass over its header.

The `gguf` package's `GGUFReader` builds numpy views of every part of every value, one per
element of an array: SmolLM2's 49k-token vocabulary and its merges take it 3.4 s a process
(benchmarks/NOTES.md, "CPU: a GGUF model's start-up"). `GGUFFile` reads the same header with
`struct` into plain Python values (numeric arrays through `np.frombuffer`), and maps each tensor
as `GGUFReader` does: a read-only view of the memory-mapped file, in the element type of
float and integer tensors or as bytes in the quantized block layout, which
engine/loading/gguf_quants.py (or `gguf.quants`, for the types it does not unpack)
dequantizes; each tensor also keeps its offset in the file, where engine/loading/gguf.py reads
its bytes from to a GPU. Little-endian files of format versions 2 and 3 (what llama.cpp writes);
anything else raises ValueError, as does a truncated or inconsistent file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Metadata value types (the GGUF specification's numbering).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Tensor types that are plain elements rather than quantized blocks, and their numpy type.
_ELEMENT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: np.ndarray  # the dimensions as stored: innermost first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file (elements, or bytes of quantized blocks)
    offset: int  # where `data` begins in the file, in bytes

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The dimensions outermost first, as numpy and torch order them ([out, in])."""
        return tuple(int(d) for d in reversed(self.shape.tolist()))


class GGUFFile:
    """`fields`: metadata key -> value (int, float, bool, str, or a list of them; numeric
    arrays as numpy arrays); `tensors`: the tensor table in file order."""

    def __init__(self, path: str) -> None:
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self.map)
        self._pos = 0
        magic = bytes(self._buf[:4])
        if magic != MAGIC:
            raise ValueError(f"not a GGUF file (starts with {magic!r})")
        self._pos = 4
        version = self._scalar(4)
        if version not in VERSIONS:
            kind = "a big-endian file" if version & 0xFFFF == 0 else f"format version {version}"
            raise ValueError(f"{kind} is not supported (little-endian versions "
                             f"{', '.join(map(str, VERSIONS))} are)")
        tensor_count, field_count = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = self._tensors(infos, start)

    def _take(self, size: int) -> memoryview:
        end = self._pos + size
        if size < 0 or end > len(self._buf):
            raise ValueError(f"truncated header: {size} bytes wanted at offset {self._pos}")
        part, self._pos = self._buf[self._pos:end], end
        return part

    def _scalar(self, kind: int):
        fmt = _SCALARS[kind]
        (value,) = struct.unpack(fmt, self._take(struct.calcsize(fmt)))
        return value

    def _string(self) -> str:
        return str(self._take(self._scalar(10)), "utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(kind)
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at offset {self._pos}")
        item, count = self._scalar(4), self._scalar(10)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).copy()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, np.ndarray, int, int]:
        name = self._string()
        dims = np.array([self._scalar(10) for _ in range(self._scalar(4))], dtype=np.int64)
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensors(self, infos, start: int) -> list[GGUFTensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        tensors, names = [], set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            kind = GGMLQuantizationType(raw_type)
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            block, size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims))
            begin, end = start + offset, start + offset + count * size // block
            if end > len(self.map):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            raw = self.map[begin:end]
            if kind.name in _ELEMENT_TYPES:
                data = raw.view(_ELEMENT_TYPES[kind.name]).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
            tensors.append(GGUFTensor(name, dims, kind, data, begin))
        return tensors
