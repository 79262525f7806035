"""A GGUF file opened for loading: its metadata parsed straight from a memory map of the file, and
every tensor a view of that map, so no byte is copied before the model's parameters are filled.

gguf's own GGUFReader makes a numpy view for every value it parses, and a 49k-token vocabulary holds
~100k strings (tokens and merges): 2.5 s of SmolLM2-135M's load went there. struct parses them in
~0.1 s. The layout (ggml's docs/gguf.md), little-endian:
  magic "GGUF", version u32 (2 or 3), tensor count u64, key/value count u64,
  key/values: key (string), value type u32 (gguf.GGUFValueType), value,
  tensor infos: name (string), n_dims u32, dims u64 x n_dims (fastest first), type u32, offset u64,
  padding up to general.alignment (default 32), then the tensor data, each at its offset from there.
A string is a u64 length and UTF-8 bytes; an array is an element type u32, a count u64, the elements."""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

V = gguf.GGUFValueType
# struct / numpy codes of the fixed-size value types
_CODES = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
          V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}
_FORMATS = {kind: struct.Struct("<" + code) for kind, code in _CODES.items()}
_U32, _U64 = _FORMATS[V.UINT32], _FORMATS[V.UINT64]
# Linux 5.14+: fault every page of a mapping in, reading the file at disk speed; Python names no constant.
_MADV_POPULATE_READ = 22
MAX_ARRAY = 1 << 24  # entries a metadata array may hold: vocabularies and merges are well under a million


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor, with the fields of gguf's ReaderTensor that the loader reads."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # F32 / F16: the values, rows first; other types: the raw bytes [rows, bytes a row]


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # every key/value as plain Python values (str, numbers, lists)
    tensors: list[GGUFTensor]


def map_file(path: Path) -> mmap.mmap:
    """The whole file mapped and read in now. Copy-on-write only so that numpy and torch take its
    pages as writable without a copy: nothing writes them, so they stay the page cache's."""
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        buffer.madvise(_MADV_POPULATE_READ)
    except OSError:  # an older kernel: pages are read as they are first touched instead
        pass
    return buffer


class _Cursor:
    """Reads values one after another from a buffer."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self.buffer, self.offset)  # struct.error past the end
        self.offset += fmt.size
        return value

    def string(self) -> str:
        length = self.unpack(_U64)
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"a string at byte {self.offset} runs past the end of the file")
        text = self.buffer[self.offset:end].decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: V) -> Any:
        if kind == V.STRING:
            return self.string()
        if kind == V.ARRAY:
            return self.array()
        return self.unpack(_FORMATS[kind])

    def array(self) -> list[Any]:
        kind, count = V(self.unpack(_U32)), self.unpack(_U64)
        if count > MAX_ARRAY:  # read as Python values, about 10x their bytes: a corrupt count asked for GiBs
            raise ValueError(f"a metadata array at byte {self.offset} claims {count} entries; at most {MAX_ARRAY} are read")
        if kind in _CODES:  # numbers: one numpy read instead of one unpack each
            dtype = np.dtype("<" + _CODES[kind])
            values = np.frombuffer(self.buffer, dtype, count, self.offset).tolist()
            self.offset += count * dtype.itemsize
            return values
        return [self.value(kind) for _ in range(count)]


def _tensor(buffer: mmap.mmap, start: int, name: str, dims: tuple[int, ...], kind: int) -> GGUFTensor:
    tensor_type = gguf.GGMLQuantizationType(kind)
    block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    rows_first = tuple(reversed(dims))
    data = np.frombuffer(buffer, np.uint8, math.prod(dims) // block * block_bytes, start)  # ValueError if cut short
    if tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = data.view(np.float32 if tensor_type == gguf.GGMLQuantizationType.F32 else np.float16)
        data = data.reshape(rows_first)
    else:
        data = data.reshape(gguf.quants.quant_shape_to_byte_shape(rows_first, tensor_type))
    return GGUFTensor(name, tensor_type, dims, data)


def read_gguf(path: Path) -> GGUFFile:
    """Parse path; raises ValueError, struct.error ... on a file that is not GGUF or is cut short."""
    buffer = map_file(path)
    cursor = _Cursor(buffer)
    if cursor.unpack(_U32) != gguf.GGUF_MAGIC:
        raise ValueError("no GGUF magic at the start")
    version = cursor.unpack(_U32)
    if version not in (2, 3):  # a big-endian file reads as a huge version
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 little-endian are)")
    num_tensors, num_values = cursor.unpack(_U64), cursor.unpack(_U64)
    metadata = {}
    for _ in range(num_values):
        key = cursor.string()
        if key in metadata:  # which value is meant is unknowable (the gguf package refuses it too)
            raise ValueError(f"metadata key {key!r} is in the file twice")
        metadata[key] = cursor.value(V(cursor.unpack(_U32)))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.unpack(_U64) for _ in range(cursor.unpack(_U32)))
        infos.append((name, dims, cursor.unpack(_U32), cursor.unpack(_U64)))
    names = [name for name, *_ in infos]
    if len(set(names)) < len(names):  # the last copy would win, silently
        raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)!r} is in the file twice")
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = [_tensor(buffer, data_start + offset, name, dims, kind) for name, dims, kind, offset in infos]
    return GGUFFile(metadata, tensors)
