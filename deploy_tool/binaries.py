"""Inspect native binaries without running them on a GPU: CUDA fatbin architectures and string counts.

Two pitfalls from the field motivate this module:

* NCCL without sm_75 (pitfall 1). The 2080 Ti box crashed in `ncclAllReduce` with "unhandled cuda error"
  because the libnccl.so.2 it loaded carried no sm_75 code; the error never names the architecture.
  `read_fatbin` lists the cubin and PTX architectures inside a shared library, the same answer as
  `cuobjdump --list-elf` / `--list-ptx`, in pure Python, and `arch_supported` decides whether they serve a
  device. A naive `strings | grep sm_75` is not a substitute: libnccl mentions "sm_75" in unrelated text.
* llama.cpp `-sm row` removed (pitfall 9). `count_strings` counts a byte string in a binary without
  loading it into memory (e.g. `split_buffer`), and `read_llama_version` reads the build and commit that
  `llama-server --version` reports.

File layout read by `read_fatbin` (little-endian ELF64 only):
  ELF header -> section header table -> sections `.nv_fatbin` (what the CUDA runtime loads, and what
  cuobjdump lists) and `__nv_relfatbin` (relocatable device code kept for device linking) -> a sequence of
  8-byte-aligned fatbin containers, each a 16-byte header `<IHHQ` (magic 0xBA55ED50, version, header size,
  payload size) -> entries, each with a header of at least 64 bytes: u16 kind at 0 (1 PTX, 2 cubin,
  8 LTO-IR), u32 header size at 4, u64 payload size at 8, u32 arch at 28 (75 = sm_75), u64 flags at 40
  (0x2000 LZ4, 0x8000 zstd payload; 0x100000 arch-specific "a" target; 0x200000 family "f" target).
Only headers are read (positioned reads on the open file), never payloads, so a 500 MB library costs a few
hundred small reads.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy_tool import proc
from deploy_tool.errors import InputError

__all__ = [
    "FatbinEntry",
    "FatbinInfo",
    "LlamaVersion",
    "POLICIES",
    "arch_supported",
    "count_strings",
    "count_strings_with_libraries",
    "find_build_number",
    "parse_llama_version",
    "read_fatbin",
    "read_llama_build_symbols",
    "read_llama_version",
]

FATBIN_MAGIC = 0xBA55ED50
RUNTIME_SECTION = ".nv_fatbin"
FATBIN_SECTIONS = (RUNTIME_SECTION, "__nv_relfatbin")

_ELF_MAGIC = b"\x7fELF"
_SHT_NOBITS = 8
_SHN_XINDEX = 0xFFFF
_KINDS = {1: "ptx", 2: "cubin", 8: "ltoir"}
_FLAG_LZ4 = 0x2000
_FLAG_ZSTD = 0x8000
_FLAG_ARCH_SPECIFIC = 0x100000  # sm_90a
_FLAG_FAMILY = 0x200000  # sm_120f
_MAX_SHSTRTAB = 16 << 20
_SCAN_WINDOW = 64 << 10

# The fact from the field write-up (FIELD-NOTES pitfall 1) and the CUDA rule the explanations cite.
FIELD_FACT = (
    "the field write-up's NCCL crash on the sm_75 cards ('ncclAllReduce failed: unhandled cuda error' under "
    "TP=2 speculative decoding) was fixed only by an NCCL built with exactly sm_75"
)
COMPAT_RULE = (
    "a cubin runs on its own major version at an equal or higher minor, e.g. sm_70 on 7.5, an 'a' cubin only "
    "on its exact version; PTX at or below the device's architecture can be JIT-compiled by the driver"
)


# --------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class FatbinEntry:
    """One fatbin entry: a cubin (machine code for one architecture) or PTX (portable code to JIT)."""

    section: str  # ".nv_fatbin" or "__nv_relfatbin"
    offset: int  # file offset of the entry header
    kind: str  # "cubin", "ptx", "ltoir" or "kind-N" for an unknown kind
    arch: str  # "sm_75", "sm_90a", "sm_120f" (PTX only; cuobjdump names family cubins plainly)
    arch_number: int  # 75
    flags: int
    payload_size: int

    @property
    def compression(self) -> str | None:
        """'lz4', 'zstd' or None for a payload stored as is."""
        if self.flags & _FLAG_ZSTD:
            return "zstd"
        if self.flags & _FLAG_LZ4:
            return "lz4"
        return None

    @property
    def compressed(self) -> bool:
        return self.compression is not None

    @property
    def arch_specific(self) -> bool:
        """True for an 'a' target (sm_90a): runs only on exactly that compute capability."""
        return bool(self.flags & _FLAG_ARCH_SPECIFIC)

    @property
    def family(self) -> bool:
        """True for an 'f' target (sm_120f): portable within the same major version only."""
        return bool(self.flags & _FLAG_FAMILY)


@dataclass(frozen=True)
class FatbinInfo:
    """The CUDA device code found in one ELF file.

    `cubin_archs` and `ptx_archs` describe `.nv_fatbin`, the section the CUDA runtime loads (and the one
    `cuobjdump --list-elf/--list-ptx` lists); `entries` holds every entry of both fatbin sections.
    """

    path: str
    has_fatbin: bool
    sections: tuple[str, ...] = ()
    entries: tuple[FatbinEntry, ...] = ()
    cubin_archs: tuple[str, ...] = field(init=False)
    ptx_archs: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cubin_archs", _sorted_archs(self.runtime_entries("cubin")))
        object.__setattr__(self, "ptx_archs", _sorted_archs(self.runtime_entries("ptx")))

    @property
    def entry_count(self) -> int:
        return len(self.entries)

    def runtime_entries(self, kind: str | None = None) -> tuple[FatbinEntry, ...]:
        """Entries of `.nv_fatbin` (optionally of one kind): the code the CUDA runtime can load."""
        return tuple(e for e in self.entries
                     if e.section == RUNTIME_SECTION and (kind is None or e.kind == kind))


def _arch_key(arch: str) -> tuple[int, str]:
    m = re.fullmatch(r"sm_(\d+)([a-z]*)", arch)
    return (int(m.group(1)), m.group(2)) if m else (1 << 30, arch)


def _sorted_archs(entries: tuple[FatbinEntry, ...]) -> tuple[str, ...]:
    return tuple(sorted({e.arch for e in entries}, key=_arch_key))


# --------------------------------------------------------------------------------------------- file access


class _File:
    """A regular file opened for positioned reads, with errors turned into InputError naming the path."""

    def __init__(self, path: Path, what: str = "an ELF shared library") -> None:
        self.path = path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise InputError(f"{path} does not exist",
                             hint="check the path (for a library the service loads, see `ldd` or LD_PRELOAD)") from None
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{path} is a directory, not {what}",
                             hint="name the file itself, e.g. .../lib/libnccl.so.2")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path} is not a regular file, so it cannot be {what}")
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except PermissionError:
            raise InputError(f"cannot read {path}: permission denied",
                             hint="run as a user who can read it, or copy it somewhere readable") from None
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from None
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pread(self, offset: int, n: int, what: str) -> bytes:
        """Exactly n bytes at offset, or InputError saying the file is truncated where `what` should be."""
        if offset < 0 or n < 0 or offset + n > self.size:
            raise InputError(
                f"{self.path} is truncated or corrupt: {what} would span bytes {offset}..{offset + n} "
                f"but the file has {self.size} bytes",
                hint="re-download or re-extract the library; a partial copy cannot be checked")
        chunks = []
        want = n
        while want:
            try:
                b = os.pread(self.fd, want, offset + n - want)
            except OSError as exc:
                raise InputError(f"cannot read {self.path}: {os.strerror(exc.errno or errno.EIO)}") from None
            if not b:
                raise InputError(f"{self.path} shrank while being read (at byte {offset + n - want})")
            chunks.append(b)
            want -= len(b)
        return b"".join(chunks)


# --------------------------------------------------------------------------------------------- ELF + fatbin


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    offset: int
    size: int
    addr: int = 0
    link: int = 0


def _elf_sections(f: _File) -> list[_Section]:
    path = f.path
    head = f.pread(0, min(f.size, 64), "the ELF header")
    if not head:
        raise InputError(f"{path} is empty (0 bytes), not an ELF shared library")
    if head[:4] != _ELF_MAGIC:
        raise InputError(f"{path} is not an ELF shared library (starts with {head[:8]!r})",
                         hint="point the check at the .so file itself, not a linker script, symlink list or archive")
    if len(head) < 5 or head[4] not in (1, 2):
        raise InputError(f"{path} is a corrupt ELF file (ELF class byte {head[4:5]!r})")
    if head[4] == 1:
        raise InputError(f"{path} is a 32-bit ELF file; CUDA libraries are 64-bit, so this is the wrong file")
    if len(head) < 6 or head[5] != 1:
        raise InputError(f"{path} is not a little-endian ELF file (data byte {head[5:6]!r}); only x86-64/aarch64 "
                         "little-endian libraries are supported")
    if len(head) < 64:
        raise InputError(f"{path} is truncated: {len(head)} bytes, shorter than a 64-byte ELF64 header")
    (e_shoff,) = struct.unpack_from("<Q", head, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", head, 0x3A)
    if e_shoff == 0:
        raise InputError(f"{path} has no section header table, so its CUDA fatbin sections cannot be located",
                         hint="use the unstripped library as shipped")
    if e_shentsize != 64:
        raise InputError(f"{path} is a corrupt ELF64 file (section header size {e_shentsize}, expected 64)")
    if e_shnum == 0 or e_shstrndx == _SHN_XINDEX:  # extended numbering lives in section 0
        s0 = f.pread(e_shoff, 64, "section header 0")
        if e_shnum == 0:
            (e_shnum,) = struct.unpack_from("<Q", s0, 0x20)
        if e_shstrndx == _SHN_XINDEX:
            (e_shstrndx,) = struct.unpack_from("<I", s0, 0x28)
    if e_shnum == 0:
        return []
    table = f.pread(e_shoff, e_shnum * 64, "the section header table")
    raw = [struct.unpack_from("<IIQQQQIIQQ", table, i * 64) for i in range(e_shnum)]
    if e_shstrndx >= e_shnum:
        raise InputError(f"{path} is a corrupt ELF file (section name table index {e_shstrndx} "
                         f"of {e_shnum} sections)")
    _n, str_type, _fl, _addr, str_off, str_size, *_ = raw[e_shstrndx]
    if str_type == _SHT_NOBITS or str_size > _MAX_SHSTRTAB:
        raise InputError(f"{path} is a corrupt ELF file (section name table of type {str_type}, {str_size} bytes)")
    strtab = f.pread(str_off, str_size, "the section name table")
    out = []
    for sh_name, sh_type, _fl, sh_addr, sh_offset, sh_size, sh_link, *_ in raw:
        if sh_name >= len(strtab) and sh_name != 0:
            raise InputError(f"{path} is a corrupt ELF file (section name offset {sh_name} outside the name table)")
        end = strtab.find(b"\0", sh_name)
        name = strtab[sh_name: end if end >= 0 else len(strtab)].decode("latin-1")
        out.append(_Section(name, sh_type, sh_offset, sh_size, sh_addr, sh_link))
    return out


def _find_magic(f: _File, start: int, end: int, base: int) -> int:
    """File offset of the next container magic at or after `start` and before `end`, 8-aligned from `base`."""
    magic = struct.pack("<I", FATBIN_MAGIC)
    pos = start
    while pos + 16 <= end:
        n = min(_SCAN_WINDOW, end - pos)
        buf = f.pread(pos, n, "fatbin padding")
        i = buf.find(magic)
        while i >= 0:
            if (pos + i - base) % 8 == 0:
                return pos + i
            i = buf.find(magic, i + 1)
        step = max(8, (n - 3) // 8 * 8)
        pos += step
    return end


def _section_entries(f: _File, sec: _Section) -> Iterator[FatbinEntry]:
    path = f.path
    base, end = sec.offset, sec.offset + sec.size
    f.pread(base, 0, f"section {sec.name}")  # bounds check only
    if end > f.size:
        raise InputError(f"{path} is truncated: section {sec.name} ends at byte {end} but the file has "
                         f"{f.size} bytes", hint="re-download or re-extract the library")
    pos = base
    while pos + 16 <= end:
        magic, _version, hsize, psize = struct.unpack("<IHHQ", f.pread(pos, 16, "a fatbin container header"))
        if magic != FATBIN_MAGIC:
            pos = _find_magic(f, pos + 8, end, base)
            continue
        if hsize < 16 or pos + hsize + psize > end:
            raise InputError(f"{path} has a corrupt fatbin container in {sec.name} at byte {pos} "
                             f"(header {hsize} bytes, payload {psize} bytes, {end - pos} bytes left in the section)")
        e, cend = pos + hsize, pos + hsize + psize
        while cend - e >= 64:
            hdr = f.pread(e, 64, "a fatbin entry header")
            kind_no, _ver, ehsize, esize = struct.unpack_from("<HHIQ", hdr, 0)
            (arch_no,) = struct.unpack_from("<I", hdr, 28)
            (flags,) = struct.unpack_from("<Q", hdr, 40)
            if ehsize < 64 or e + ehsize + esize > cend:
                raise InputError(f"{path} has a corrupt fatbin entry in {sec.name} at byte {e} "
                                 f"(header {ehsize} bytes, payload {esize} bytes, {cend - e} bytes left "
                                 "in its container)")
            kind = _KINDS.get(kind_no, f"kind-{kind_no}")
            suffix = ""
            if flags & _FLAG_ARCH_SPECIFIC:
                suffix = "a"
            elif flags & _FLAG_FAMILY and kind != "cubin":
                suffix = "f"  # cuobjdump shows family cubins under their plain name
            yield FatbinEntry(section=sec.name, offset=e, kind=kind, arch=f"sm_{arch_no}{suffix}",
                              arch_number=arch_no, flags=flags, payload_size=esize)
            e += ehsize + esize
        pos = cend + (-(cend - base) % 8)


def read_fatbin(path: str | os.PathLike[str]) -> FatbinInfo:
    """List the CUDA cubins and PTX inside an ELF64 shared library (like cuobjdump, without loading it).

    Raises InputError (naming the path) for a missing, unreadable, non-ELF, 32-bit, truncated or corrupt
    file. An ELF without fatbin sections is not an error: it gives `has_fatbin=False` and no archs.
    """
    p = Path(path)
    with _File(p) as f:
        sections = [s for s in _elf_sections(f) if s.name in FATBIN_SECTIONS and s.type != _SHT_NOBITS]
        entries: list[FatbinEntry] = []
        for sec in sections:
            entries.extend(_section_entries(f, sec))
    return FatbinInfo(path=str(p), has_fatbin=bool(sections),
                      sections=tuple(dict.fromkeys(s.name for s in sections)), entries=tuple(entries))


# --------------------------------------------------------------------------------------------- arch policy

POLICIES = ("exact", "compatible")


def _parse_cc(cc: str) -> tuple[int, int]:
    s = str(cc).strip()
    m = re.fullmatch(r"(\d+)\.(\d)", s) or re.fullmatch(r"(?:sm_|compute_)?(\d+)(\d)", s)
    if not m:
        raise InputError(f"compute capability {cc!r} is not of the form MAJOR.MINOR",
                         hint="e.g. 7.5 for an RTX 2080 Ti (see `nvidia-smi --query-gpu=compute_cap --format=csv`)")
    return int(m.group(1)), int(m.group(2))


def _runs_cubin(e: FatbinEntry, major: int, minor: int) -> bool:
    a_major, a_minor = divmod(e.arch_number, 10)
    if e.arch_specific:
        return (a_major, a_minor) == (major, minor)
    return a_major == major and a_minor <= minor


def _jits_ptx(e: FatbinEntry, major: int, minor: int) -> bool:
    a_major, a_minor = divmod(e.arch_number, 10)
    if e.arch_specific:
        return (a_major, a_minor) == (major, minor)
    if e.family:
        return a_major == major and a_minor <= minor
    return e.arch_number <= major * 10 + minor


def runnable_code(info: FatbinInfo, cc: str) -> str | None:
    """What of the library's device code a GPU of compute capability `cc` runs: "cubin" (machine code, exact or
    by CUDA's compatibility rule), "ptx" (only PTX the driver compiles at start), or None (nothing)."""
    major, minor = _parse_cc(cc)
    if any(_runs_cubin(e, major, minor) for e in info.runtime_entries("cubin")):
        return "cubin"
    if any(_jits_ptx(e, major, minor) for e in info.runtime_entries("ptx")):
        return "ptx"
    return None


def arch_supported(info: FatbinInfo, cc: str = "7.5", policy: str = "exact") -> tuple[bool, str]:
    """Whether the library's device code serves a GPU of compute capability `cc`, and why (one paragraph).

    policy "exact": an sm_<cc> cubin must be present (what fixed the field crash; the default).
    policy "compatible": also accept a same-major lower-minor cubin or PTX the driver can JIT.
    """
    if policy not in POLICIES:
        raise InputError(f"unknown architecture policy {policy!r}: use 'exact' or 'compatible'",
                         hint="'exact' (the default) requires a cubin for the device's own architecture")
    major, minor = _parse_cc(cc)
    want = f"sm_{major}{minor}"
    name = Path(info.path).name
    if not info.has_fatbin:
        return False, (f"{name} contains no CUDA device code (no .nv_fatbin section), so it has no {want} "
                       f"cubin. {FIELD_FACT}.")
    cubins = info.runtime_entries("cubin")
    ptx = info.runtime_entries("ptx")
    found = (f"{name} has cubins for {', '.join(info.cubin_archs) or 'no architecture'} and PTX for "
             f"{', '.join(info.ptx_archs) or 'no architecture'}")
    number = major * 10 + minor
    exact = {e.arch for e in cubins if e.arch_number == number and _runs_cubin(e, major, minor)}
    compat = sorted({e.arch for e in cubins if _runs_cubin(e, major, minor)} - exact, key=_arch_key)
    jit = sorted({e.arch for e in ptx if _jits_ptx(e, major, minor)}, key=_arch_key)
    if exact:
        return True, (f"{found}. It has an exact {want} cubin, so policy '{policy}' is met "
                      f"(that is the kind of build that worked in the field: {FIELD_FACT}).")
    others = []
    if compat:
        others.append(f"the {', '.join(compat)} cubin")
    if jit:
        others.append(f"the {', '.join(jit)} PTX (by JIT)")
    usable = " and ".join(others)
    if not others:
        return False, (f"{found}. It has no {want} cubin and nothing else that runs on a {major}.{minor} device "
                       f"under CUDA's compatibility rule ({COMPAT_RULE}). Note that {FIELD_FACT}.")
    if policy == "compatible":
        return True, (f"{found}. It has no {want} cubin, but policy 'compatible' accepts {usable} "
                      f"under CUDA's compatibility rule ({COMPAT_RULE}). Caution: {FIELD_FACT}.")
    return False, (f"{found}. It has no {want} cubin, and policy 'exact' requires one. Under CUDA's "
                   f"compatibility rule ({COMPAT_RULE}), "
                   f"{usable} would serve a {major}.{minor} device, so policy 'compatible' would accept it; "
                   f"'exact' is the default because {FIELD_FACT}.")


# --------------------------------------------------------------------------------------------- strings


def count_strings(path: str | os.PathLike[str], needle: bytes, *, chunk_size: int = 1 << 20) -> int:
    """How many times `needle` occurs in the file (overlapping occurrences counted), read in chunks.

    Used for pitfall 9: `split_buffer` is gone from llama.cpp builds after `-sm row` was removed.
    """
    if not needle:
        raise ValueError("needle must not be empty")
    if chunk_size < 1:
        raise ValueError("chunk_size must be positive")
    keep = len(needle) - 1
    count = 0
    with _File(Path(path), "a binary") as f:
        carry = b""
        offset = 0
        while offset < f.size:
            chunk = f.pread(offset, min(chunk_size, f.size - offset), "a chunk")
            offset += len(chunk)
            buf = carry + chunk
            i = buf.find(needle)
            while i >= 0:
                count += 1
                i = buf.find(needle, i + 1)
            carry = buf[-keep:] if keep else b""
    return count


def count_strings_with_libraries(path: str | os.PathLike[str], needle: bytes) -> dict[str, int]:
    """`count_strings` over an executable and every `lib*.so*` file beside it: {file path: count}.

    llama.cpp's default shared-library build keeps almost nothing in `llama-server` itself (the skulk build's
    executable has 0 `split_buffer`, its libllama.so 1), and backends such as libggml-cuda.so are opened at run
    time rather than linked, so a pitfall-9 check must look at the whole directory, not the executable alone.
    Hard links and symlinks to a file already counted are skipped.
    """
    p = Path(path)
    files = [p]
    if p.parent.is_dir():
        files += sorted(q for q in p.parent.iterdir() if re.match(r"lib.*\.so(\.|$)", q.name) and q != p)
    out: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    for q in files:
        try:
            st = q.stat()
        except OSError:
            if q == p:
                count_strings(q, needle)  # raises the clear InputError for the named file
            continue  # a dangling library symlink is not the named file's problem
        if (st.st_dev, st.st_ino) in seen or (q != p and not stat.S_ISREG(st.st_mode)):
            continue
        seen.add((st.st_dev, st.st_ino))
        out[str(q)] = count_strings(q, needle)
    return out


# --------------------------------------------------------------------------------------------- llama.cpp version


@dataclass(frozen=True)
class LlamaVersion:
    """What `llama-server --version` says about its build."""

    version: str | None  # "0.1.0-dev" on builds that print a version before the build number
    build_number: int | None  # 10064 for b10064
    commit: str | None  # short git hash
    text: str  # the raw output, for messages

    @property
    def build(self) -> str | None:
        """'b10064', or None when the number is absent or the placeholder of a shallow clone."""
        if self.build_number is None or self.build_number <= 1:
            return None
        return f"b{self.build_number}"


_VERSION_PATTERNS = (
    # newer builds: "version: 0.1.0-dev (build 1, commit 7e4c0a9)"
    re.compile(r"^version:\s*(?P<version>\S+)\s+\(build\s+(?P<build>\d+),\s*commit\s+(?P<commit>[0-9a-zA-Z]+)\)",
               re.M),
    # older builds: "version: 4567 (abc1234d)"
    re.compile(r"^version:\s*(?P<build>\d+)\s+\((?P<commit>[0-9a-zA-Z]+)\)", re.M),
)


def parse_llama_version(text: str) -> LlamaVersion:
    """Parse the output of `llama-server --version`; fields it cannot find are None."""
    for pat in _VERSION_PATTERNS:
        m = pat.search(text)
        if m:
            gd = m.groupdict()
            commit = gd["commit"]
            return LlamaVersion(version=gd.get("version"), build_number=int(gd["build"]),
                                commit=None if commit == "unknown" else commit, text=text.strip())
    return LlamaVersion(version=None, build_number=None, commit=None, text=text.strip())


class _VersionRunFailed(InputError):
    """`llama-server --version` ran but failed before printing its build."""


def read_llama_version(path: str | os.PathLike[str], *, timeout: float = 30) -> LlamaVersion:
    """Run `<path> --version` (it loads no model and needs no GPU) and parse what it prints."""
    p = Path(path)
    _File(p, "a llama-server binary").close()  # same clear errors for missing/directory/unreadable as the other readers
    if not os.access(p, os.X_OK):
        raise InputError(f"{p} is not executable", hint="point at the llama-server binary itself")
    res = proc.run([str(p), "--version"], ok=range(256), timeout=timeout)
    text = res.stderr + res.stdout  # llama.cpp prints build info on stderr
    info = parse_llama_version(text)
    if res.returncode != 0 and info.build_number is None:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise _VersionRunFailed(f"{p} --version failed (exit {res.returncode}): {tail or 'no output'}",
                         hint="a missing shared library (e.g. libcuda.so.1) stops it before it prints anything")
    return info


_SHT_SYMTAB, _SHT_RELA, _SHT_DYNSYM = 2, 4, 11
_RELATIVE = {0x3E: 8, 0xB7: 1027}  # e_machine -> R_*_RELATIVE (x86-64, aarch64)
_MAX_TABLE = 64 << 20


def _vaddr_to_offset(sections: list[_Section], vaddr: int, n: int) -> int | None:
    for s in sections:
        if s.addr and s.type != _SHT_NOBITS and s.addr <= vaddr and vaddr + n <= s.addr + s.size:
            return s.offset + (vaddr - s.addr)
    return None


def _build_symbols(path: Path) -> tuple[int | None, str | None]:
    """LLAMA_BUILD_NUMBER and LLAMA_COMMIT as compiled into one ELF file, if it defines them."""
    with _File(path) as f:
        sections = _elf_sections(f)
        (machine,) = struct.unpack("<H", f.pread(0x12, 2, "the ELF machine field"))
        found: dict[str, int] = {}
        for symtab in (s for s in sections if s.type in (_SHT_DYNSYM, _SHT_SYMTAB)):
            if symtab.link >= len(sections) or symtab.size > _MAX_TABLE:
                continue
            strsec = sections[symtab.link]
            if strsec.size > _MAX_TABLE:
                continue
            strtab = f.pread(strsec.offset, strsec.size, "a symbol name table")
            table = f.pread(symtab.offset, symtab.size, "a symbol table")
            for i in range(0, len(table) - 23, 24):
                st_name, _info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", table, i)
                if st_shndx == 0 or st_shndx >= len(sections) or sections[st_shndx].type == _SHT_NOBITS:
                    continue  # undefined, or a copy-relocated slot whose value lives in a library
                name = strtab[st_name: strtab.find(b"\0", st_name)]
                if name in (b"LLAMA_BUILD_NUMBER", b"LLAMA_COMMIT"):
                    found.setdefault(name.decode(), st_value)
        build = commit = None
        if "LLAMA_BUILD_NUMBER" in found:
            off = _vaddr_to_offset(sections, found["LLAMA_BUILD_NUMBER"], 4)
            if off is not None:
                (build,) = struct.unpack("<i", f.pread(off, 4, "LLAMA_BUILD_NUMBER"))
        if "LLAMA_COMMIT" in found:
            slot = found["LLAMA_COMMIT"]
            off = _vaddr_to_offset(sections, slot, 8)
            target = struct.unpack("<Q", f.pread(off, 8, "LLAMA_COMMIT"))[0] if off is not None else 0
            if not target and machine in _RELATIVE:  # position-independent: the pointer is a RELATIVE relocation
                for rela in (s for s in sections if s.type == _SHT_RELA and s.size <= _MAX_TABLE):
                    rows = f.pread(rela.offset, rela.size, "a relocation table")
                    for j in range(0, len(rows) - 23, 24):
                        r_offset, r_info, r_addend = struct.unpack_from("<QQq", rows, j)
                        if r_offset == slot and r_info & 0xFFFFFFFF == _RELATIVE[machine]:
                            target = r_addend
                            break
            soff = _vaddr_to_offset(sections, target, 1) if target else None
            if soff is not None:
                raw = f.pread(soff, min(64, f.size - soff), "the commit string").split(b"\0", 1)[0]
                text = raw.decode("ascii", "replace")
                commit = text if re.fullmatch(r"[0-9a-zA-Z]{4,40}", text) and text != "unknown" else None
    return build, commit


def read_llama_build_symbols(path: str | os.PathLike[str]) -> LlamaVersion:
    """The build number and commit compiled into llama.cpp, read from ELF symbols without running anything.

    Looks in the executable itself (static builds), then in libllama-common / libcommon beside it (shared-library
    builds keep `LLAMA_BUILD_NUMBER` and `LLAMA_COMMIT` there). Useful where `--version` cannot run, e.g. a CUDA
    build on a host without the driver's libcuda.so.1.
    """
    p = Path(path)
    candidates = [p]
    if p.parent.is_dir():
        candidates += sorted(q for q in p.parent.iterdir()
                             if re.match(r"lib(llama-)?common\.so", q.name) and q.is_file())
    for c in candidates:
        build, commit = _build_symbols(c)
        if build is not None or commit is not None:
            return LlamaVersion(version=None, build_number=build, commit=commit, text=f"symbols of {c}")
    return LlamaVersion(version=None, build_number=None, commit=None, text="")


def find_build_number(path: str | os.PathLike[str], *, timeout: float = 30) -> str | None:
    """llama.cpp's build tag ('b10064') of a llama-server, or None if the binary does not know it.

    Asks `<path> --version`; when the binary cannot run here (exit 127 for a missing library, say), reads the
    same numbers from its ELF symbols instead. A build made from a shallow git clone reports "build 1" (git
    counted one commit): a placeholder, so None; `read_llama_version(path).commit` still names the commit.
    """
    try:
        info = read_llama_version(path, timeout=timeout)
    except _VersionRunFailed:
        info = read_llama_build_symbols(path)
    return info.build


# --------------------------------------------------------------------------------------------- dynamic section

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 10, 14, 15, 29
_MAX_DYNAMIC = 1 << 20


@dataclass(frozen=True)
class ElfDynamic:
    """What the dynamic loader reads from an ELF file's dynamic section (the answer of `readelf -d`)."""

    path: str
    elf_class: int  # 1: 32-bit, 2: 64-bit
    machine: int  # e_machine (0x3E x86-64, 0xB7 aarch64, 3 i386)
    needed: tuple[str, ...] = ()
    soname: str | None = None
    rpath: tuple[str, ...] = ()
    runpath: tuple[str, ...] = ()


def is_elf(path: str | os.PathLike[str]) -> bool:
    """True for a regular file (links not followed) that starts with the ELF magic."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, 4, 0) == _ELF_MAGIC
    finally:
        os.close(fd)


def read_dynamic(path: str | os.PathLike[str]) -> ElfDynamic:
    """DT_NEEDED, DT_SONAME, DT_RPATH and DT_RUNPATH of an ELF file (32/64-bit, either byte order), found the way
    the loader finds them: PT_DYNAMIC, and its DT_STRTAB address mapped to the file through the PT_LOAD
    segments (section headers are not needed; stripped files work). A static executable has none of them."""
    p = Path(path)
    with _File(p, "an ELF file") as f:
        head = f.pread(0, min(f.size, 64), "the ELF header")
        if head[:4] != _ELF_MAGIC or len(head) < 52:
            raise InputError(f"{p} is not an ELF file")
        cls, data = head[4], head[5]
        if cls not in (1, 2) or data not in (1, 2):
            raise InputError(f"{p} is a corrupt ELF file (class {cls}, data {data})")
        if len(head) < (64 if cls == 2 else 52):
            raise InputError(f"{p} is truncated: {len(head)} bytes, shorter than its ELF header")
        e = "<" if data == 1 else ">"
        (machine,) = struct.unpack_from(e + "H", head, 0x12)
        if cls == 2:
            (phoff,) = struct.unpack_from(e + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(e + "HH", head, 0x36)
            ph_fmt, want_ent, dyn_fmt = e + "IIQQQQQQ", 56, e + "qQ"
        else:
            (phoff,) = struct.unpack_from(e + "I", head, 0x1C)
            phentsize, phnum = struct.unpack_from(e + "HH", head, 0x2A)
            ph_fmt, want_ent, dyn_fmt = e + "IIIIIIII", 32, e + "iI"
        if phnum == 0:
            return ElfDynamic(str(p), cls, machine)
        if phentsize != want_ent:
            raise InputError(f"{p} is a corrupt ELF file (program header size {phentsize})")
        table = f.pread(phoff, phnum * phentsize, "the program header table")
        loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
        dyn: tuple[int, int] | None = None
        for i in range(phnum):
            row = struct.unpack_from(ph_fmt, table, i * phentsize)
            if cls == 2:
                p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = row[:6]
            else:
                p_type, p_offset, p_vaddr, _paddr, p_filesz = row[:5]
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dyn = (p_offset, p_filesz)
        if dyn is None:
            return ElfDynamic(str(p), cls, machine)
        raw = f.pread(dyn[0], min(dyn[1], _MAX_DYNAMIC, f.size - dyn[0]), "the dynamic section")
        step = struct.calcsize(dyn_fmt)
        tags: list[tuple[int, int]] = []
        for i in range(0, len(raw) - step + 1, step):
            tag, val = struct.unpack_from(dyn_fmt, raw, i)
            if tag == _DT_NULL:
                break
            tags.append((tag, val))
        strtab = next((v for t, v in tags if t == _DT_STRTAB), None)
        strsz = next((v for t, v in tags if t == _DT_STRSZ), None)
        if strtab is None or strsz is None:
            return ElfDynamic(str(p), cls, machine)
        off = next((o + strtab - va for va, o, n in loads if va <= strtab < va + n), None)
        if off is None or strsz > _MAX_TABLE:
            raise InputError(f"{p} is a corrupt ELF file (its dynamic string table lies outside the file)")
        strings = f.pread(off, min(strsz, f.size - off), "the dynamic string table")

        def text(i: int) -> str:
            if i >= len(strings):
                raise InputError(f"{p} is a corrupt ELF file (dynamic string offset {i} past the table)")
            end = strings.find(b"\0", i)
            return strings[i: end if end >= 0 else len(strings)].decode("utf-8", "surrogateescape")

        def dirs(tag: int) -> tuple[str, ...]:
            return tuple(d for t, v in tags if t == tag for d in text(v).split(":") if d)

        soname = next((text(v) for t, v in tags if t == _DT_SONAME), None)
        return ElfDynamic(str(p), cls, machine, tuple(text(v) for t, v in tags if t == _DT_NEEDED), soname,
                          dirs(_DT_RPATH), dirs(_DT_RUNPATH))


# --------------------------------------------------------------------------------------------- OS libraries

# The Debian package that provides a library these backends need from the OS (no dpkg, no network at check
# time). A library not listed is named without a package.
DEBIAN_PACKAGES = {
    "libgomp.so.1": "libgomp1", "libstdc++.so.6": "libstdc++6", "libgcc_s.so.1": "libgcc-s1",
    "libatomic.so.1": "libatomic1", "libquadmath.so.0": "libquadmath0", "libgfortran.so.5": "libgfortran5",
    **{n: "libc6" for n in ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                            "libutil.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1")},
    "libnuma.so.1": "libnuma1", "libvulkan.so.1": "libvulkan1", "libOpenCL.so.1": "ocl-icd-libopencl1",
    "libcuda.so.1": "the NVIDIA driver (libcuda1, or the driver's own installer)",
    "libnvidia-ml.so.1": "the NVIDIA driver (libnvidia-ml1, or the driver's own installer)",
    "libz.so.1": "zlib1g", "libssl.so.3": "libssl3", "libcrypto.so.3": "libssl3", "libcurl.so.4": "libcurl4",
    "libopenblas.so.0": "libopenblas0", "libnccl.so.2": "the bundle's NCCL or nvidia-nccl-cu12 in the lock",
    **{n: f"nvidia-{p}-cu12 in the lock (pip), or the CUDA toolkit" for n, p in (
        ("libcudart.so.12", "cuda-runtime"), ("libcublas.so.12", "cublas"), ("libcublasLt.so.12", "cublas"))},
}

_MULTIARCH = {(2, 0x3E): "x86_64-linux-gnu", (2, 0xB7): "aarch64-linux-gnu", (1, 3): "i386-linux-gnu"}
_LD_CACHE_NEW = b"glibc-ld.so.cache1.1"


def default_lib_dirs(elf_class: int, machine: int) -> list[str]:
    """The loader's trusted directories on Debian/Ubuntu (multiarch first), after ld.so.cache."""
    arch = _MULTIARCH.get((elf_class, machine))
    out = [f"/lib/{arch}", f"/usr/lib/{arch}"] if arch else []
    return out + (["/lib64", "/usr/lib64"] if elf_class == 2 else []) + ["/lib", "/usr/lib"]


def read_ld_so_cache(path: str | os.PathLike[str] = "/etc/ld.so.cache") -> dict[str, list[str]]:
    """{library name: [paths]} from glibc's ld.so.cache (the new format, alone or after the old one); a missing
    or unreadable cache is empty (the loader then only searches the default directories)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return {}
    start = data.find(_LD_CACHE_NEW)
    if start < 0 or len(data) < start + 48:
        return {}
    nlibs, _strlen = struct.unpack_from("<II", data, start + 20)
    out: dict[str, list[str]] = {}

    def cstr(off: int) -> str | None:
        i = start + off
        if not 0 <= i < len(data):
            return None
        end = data.find(b"\0", i)
        return data[i: end if end >= 0 else len(data)].decode("utf-8", "surrogateescape")

    for i in range(nlibs):
        pos = start + 48 + i * 24
        if pos + 24 > len(data):
            break
        _flags, key, value = struct.unpack_from("<iII", data, pos)
        name, where = cstr(key), cstr(value)
        if name and where:
            out.setdefault(name, []).append(where)
    return out


@dataclass(frozen=True)
class MissingLibrary:
    name: str  # the DT_NEEDED entry
    needed_by: str  # the file that needs it
    package: str | None  # the Debian package that provides it, if known

    def describe(self) -> str:
        pkg = f" (Debian package: {self.package})" if self.package else ""
        return f"{self.name}{pkg}, needed by {self.needed_by}"


def _matches(path: str, elf_class: int, machine: int) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    if len(head) < 20 or head[:4] != _ELF_MAGIC or head[4] != elf_class:
        return False
    return struct.unpack_from("<H" if head[5] == 1 else ">H", head, 18)[0] == machine


def _expand(d: str, origin: str) -> str | None:
    d = d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
    return None if "$" in d else d  # $LIB, $PLATFORM: not used by these backends; such a dir is skipped


def provided_names(files: Sequence[str | os.PathLike[str]]) -> dict[str, str]:
    """{file name and DT_SONAME: path} of the bundle's own ELF files (what a NEEDED entry may find there)."""
    by_name: dict[str, str] = {}
    for p in files:
        by_name.setdefault(os.path.basename(p), str(p))
        try:
            so = read_dynamic(p).soname
        except InputError:
            continue
        if so:
            by_name.setdefault(so, str(p))
    return by_name


def missing_libraries(roots: Sequence[str | os.PathLike[str]],
                      provided: Sequence[str | os.PathLike[str]] | dict[str, str] = (), *,
                      sysroot: str = "/", ld_cache: dict[str, list[str]] | None = None,
                      closure: set[str] | None = None) -> list[MissingLibrary]:
    """Every DT_NEEDED entry of `roots` and of the libraries they load from `provided` (the bundle's own ELF
    files) that cannot be resolved, searched as the dynamic loader does: the object's DT_RPATH (when it has no
    DT_RUNPATH, together with the RPATH of the objects that loaded it) or DT_RUNPATH, $ORIGIN expanded; then a
    library of that name the bundle provides (the venv's lib dirs, already-loaded sonames); then ld.so.cache;
    then the default directories. Candidates must be ELF files of the same class and machine. Libraries found in
    the OS are not followed further (their own needs are the OS's business). `sysroot` prefixes every OS path
    (a test's minimal box); `ld_cache` overrides <sysroot>/etc/ld.so.cache; `closure` collects the files
    visited (the roots and the bundle's libraries they load)."""
    by_name = provided if isinstance(provided, dict) else provided_names(provided)
    cache = ld_cache if ld_cache is not None else read_ld_so_cache(os.path.join(sysroot, "etc/ld.so.cache"))

    def osp(p: str) -> str:
        return os.path.join(sysroot, p.lstrip("/")) if sysroot != "/" else p

    missing: dict[str, MissingLibrary] = {}
    seen: set[str] = set()
    queue: list[tuple[str, tuple[str, ...]]] = [(str(r), ()) for r in roots]
    while queue:
        path, inherited = queue.pop(0)
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        if closure is not None:
            closure.add(path)
        dyn = read_dynamic(path)
        origin = os.path.dirname(os.path.abspath(path))
        own_rpath = tuple(x for d in dyn.rpath if (x := _expand(d, origin)))
        rpath = () if dyn.runpath else own_rpath + inherited
        runpath = tuple(x for d in dyn.runpath if (x := _expand(d, origin)))
        for need in dyn.needed:
            found: str | None = None
            in_bundle = False
            if "/" in need:
                found = need if _matches(need, dyn.elf_class, dyn.machine) else None
            else:
                for d in (*rpath, *runpath):
                    cand = os.path.join(d, need)
                    if _matches(cand, dyn.elf_class, dyn.machine):
                        found, in_bundle = cand, True
                        break
                if found is None and need in by_name and _matches(by_name[need], dyn.elf_class, dyn.machine):
                    found, in_bundle = by_name[need], True
                if found is None:
                    for cand in [osp(c) for c in cache.get(need, [])] + \
                            [osp(os.path.join(d, need)) for d in default_lib_dirs(dyn.elf_class, dyn.machine)]:
                        if _matches(cand, dyn.elf_class, dyn.machine):
                            found = cand
                            break
            if found is None:
                missing.setdefault(need, MissingLibrary(need, str(path), DEBIAN_PACKAGES.get(need)))
            elif in_bundle:
                queue.append((found, own_rpath + inherited if not dyn.runpath else inherited))
    return sorted(missing.values(), key=lambda m: m.name)


# ftllm loads the first of these that loads (ftllm/llm.py): the CUDA build, then the CUDA 11 build, then the CPU
# build. On a CPU box the CUDA builds fail to load for want of the driver and that is expected; on a GPU box the
# CUDA build must load, or ftllm would silently run on the CPU.
FTLLM_LIBS = ("libfastllm_tools.so", "libfastllm_tools-cu11.so", "libfastllm_tools-cpu.so")


def venv_elf_files(root: str | os.PathLike[str]) -> list[str]:
    """Every ELF file under `root` (shared objects and executables; symlinks not followed), sorted."""
    out = []

    def walk(d: str) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                walk(e.path)
            elif e.is_file(follow_symlinks=False) and (e.name.endswith(".so") or ".so." in e.name or (
                    not e.name.endswith((".py", ".pyc", ".txt", ".pyi")) and e.stat(follow_symlinks=False).st_mode & 0o111)) \
                    and is_elf(e.path):
                out.append(e.path)

    walk(os.fspath(root))
    return out


def release_missing_libraries(venv: str | os.PathLike[str], *, ftllm_devices: Collection[str] = frozenset(),
                              extra: Sequence[str | os.PathLike[str]] = (), sysroot: str = "/",
                              ld_cache: dict[str, list[str]] | None = None,
                              files: Sequence[str] | None = None) -> list[MissingLibrary]:
    """The OS libraries a release's native binaries need and the box lacks: every ELF file of the venv (and the
    `extra` files, e.g. the bundled NCCL or a llama-server outside the venv), their NEEDED entries resolved as
    the loader does. ftllm's builds are alternatives (FTLLM_LIBS): for a cuda backend its CUDA build must
    resolve; for a cpu backend one of them is enough (the CPU build's needs are named if none resolves).
    `files`: venv_elf_files(venv), when the caller has it already."""
    files = list(venv_elf_files(venv) if files is None else files)
    alts = [p for p in files if os.path.basename(p) in FTLLM_LIBS and os.path.basename(os.path.dirname(p)) == "ftllm"]
    roots = [p for p in files if p not in alts] + [str(x) for x in extra]
    provided = provided_names(files + [str(x) for x in extra])
    if ld_cache is None:
        ld_cache = read_ld_so_cache(os.path.join(sysroot, "etc/ld.so.cache"))
    out = {m.name: m for m in missing_libraries(roots, provided, sysroot=sysroot, ld_cache=ld_cache)}
    by_name = {os.path.basename(p): p for p in alts}
    if alts and ftllm_devices:
        checks = {p: missing_libraries([p], provided, sysroot=sysroot, ld_cache=ld_cache) for p in alts}
        if "cuda" in ftllm_devices and FTLLM_LIBS[0] in by_name:
            out.update({m.name: m for m in checks[by_name[FTLLM_LIBS[0]]]})
        if not any(not v for v in checks.values()):
            pick = by_name.get(FTLLM_LIBS[2]) or next(iter(checks))
            out.update({m.name: m for m in checks[pick]})
    return sorted(out.values(), key=lambda m: m.name)
