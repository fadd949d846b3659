"""Read a GGUF file's header (metadata keys and tensor infos) in pure Python, without loading any weights.

Used by `check`: ftllm dies with SIGFPE on a GGUF whose weight matrices are F32, and llama.cpp's Q8_0 weights
with f16 KV do not fit 262,144 tokens on the field box. Only the header is read (buffered, sequential), and
every count and length is bounded by the file size, so a corrupt or hostile file gives an InputError.

Layout (little-endian): magic b"GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata count; metadata as
(string key, u32 type, value); tensor infos as (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type,
u64 offset). A string is a u64 length plus UTF-8 bytes; an array is u32 item type, u64 count, items.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from deploy_tool.errors import InputError

GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
# llama.cpp's general.file_type values (LLAMA_FTYPE_*) for the names the checks use
FILE_TYPE_NAMES = {0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0",
                   8: "MOSTLY_Q5_0", 9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 15: "MOSTLY_Q4_K_M",
                   17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K", 32: "MOSTLY_BF16"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.ggml_type, f"type-{self.ggml_type}")


@dataclass(frozen=True)
class GgufHeader:
    path: str
    version: int
    metadata: dict[str, object]  # arrays are summarised as ("array", item type, count)
    tensors: tuple[TensorInfo, ...]

    @property
    def file_type(self) -> int | None:
        v = self.metadata.get("general.file_type")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def file_type_name(self) -> str | None:
        ft = self.file_type
        return None if ft is None else FILE_TYPE_NAMES.get(ft, f"file-type-{ft}")

    def f32_matrices(self) -> list[TensorInfo]:
        """Weight matrices (2 or more dimensions) stored as F32."""
        return [t for t in self.tensors if t.ggml_type == 0 and len(t.shape) >= 2]


class _Reader:
    def __init__(self, f: BinaryIO, size: int, path: Path) -> None:
        self.f, self.size, self.path = f, size, path

    def bad(self, what: str) -> InputError:
        return InputError(f"{self.path} is not a valid GGUF file: {what}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.bad(f"truncated at byte {self.f.tell()}")
        return self.f.read(n)

    def scalar(self, fmt: str) -> object:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return int(self.scalar("<I"))  # type: ignore[call-overload]

    def u64(self) -> int:
        return int(self.scalar("<Q"))  # type: ignore[call-overload]

    def string(self) -> str:
        n = self.u64()
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> object:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth > 2:
                raise self.bad("arrays nested too deeply")
            itype, count = self.u32(), self.u64()
            if count > self.size:
                raise self.bad(f"array of {count} items in a {self.size}-byte file")
            if itype in _SCALARS:
                self.take(struct.calcsize(_SCALARS[itype]) * count)
            else:
                for _ in range(count):
                    self.value(itype, depth + 1)
            return ("array", itype, count)
        raise self.bad(f"unknown metadata type {vtype}")


def read_header(path: str | os.PathLike[str]) -> GgufHeader:
    """Metadata and tensor infos of a GGUF file (InputError naming the path when it is not one)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        f = open(p, "rb", buffering=1 << 16)  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror}") from None
    with f:
        r = _Reader(f, size, p)
        try:
            if r.take(4) != b"GGUF":
                raise r.bad("no GGUF magic")
            version = r.u32()
            if version not in (2, 3):
                raise r.bad(f"unsupported version {version}")
            n_tensors, n_kv = r.u64(), r.u64()
            if n_tensors > size or n_kv > size:
                raise r.bad("counts larger than the file")
            meta: dict[str, object] = {}
            for _ in range(n_kv):
                key = r.string()
                meta[key] = r.value(r.u32())
            tensors = []
            for _ in range(n_tensors):
                name = r.string()
                nd = r.u32()
                if nd > _MAX_DIMS:
                    raise r.bad(f"tensor {name!r} has {nd} dimensions")
                shape = tuple(r.u64() for _ in range(nd))
                ttype = r.u32()
                r.u64()  # data offset
                tensors.append(TensorInfo(name, shape, ttype))
        except OSError as exc:
            raise InputError(f"cannot read {p}: {exc.strerror}") from None
    return GgufHeader(str(p), version, meta, tuple(tensors))
