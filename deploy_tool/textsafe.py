"""Text from outside (a bundle, a config, the file system) made safe for a terminal, a log and a unit file.

    q(name)            a name for a message: quoted, every control character escaped ('a\\x1b[2Jb')
    key(name)          one component of a key path: as it is when printable, else q(name)
    unsafe_char(text)  the first character a config value may not hold (None when there is none)
    describe(c)        'U+000A (LINE FEED)': how a message names such a character

A name is printed with q() wherever it comes from (a MANIFEST, a tar member, a directory listing, a config
key): an escape sequence or a carriage return in a file name then shows as text instead of acting on the
terminal (moving the cursor, rewriting the line before it, setting the window title). q() is repr() of the
text: Python escapes every character that is not printable (C0 and C1 controls, DEL, line and paragraph
separators, bidirectional overrides and other format characters, lone surrogates from undecodable file
names) and the backslash itself, so the quoted form reads back to exactly the name.

Standard library only; imported by config, render and the modules that print names (no imports back).
"""

from __future__ import annotations

import os
import re
import unicodedata

# Bidirectional formatting characters: invisible, and they reorder the text around them ("Trojan Source").
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def q(name: object) -> str:
    """`name` quoted for a message, with every non-printable character escaped (bytes: decoded as file
    names are, undecodable bytes escaped)."""
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    return repr(name if isinstance(name, str) else os.fspath(name) if isinstance(name, os.PathLike) else str(name))


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def safe(text: str) -> str:
    """Text for one terminal or journal line: control characters and undecodable bytes of file names (surrogate
    escapes) written as Python escapes (\\n, \\x1b, \\udcff)."""
    return _UNSAFE.sub(lambda m: ascii(m.group(0))[1:-1], text)


def key(name: str) -> str:
    """One component of a key path (`backends.<name>.env.<KEY>`): as it is when printable, else quoted by q()."""
    return name if name and name.isprintable() and "." not in name else q(name)


def _noncharacter(o: int) -> bool:
    return 0xFDD0 <= o <= 0xFDEF or (o & 0xFFFE) == 0xFFFE


def unsafe_char(text: str) -> str | None:
    """The first character of `text` that no config value may hold, else None: control characters (C0 with
    TAB, CR, LF and NUL, DEL, C1), line and paragraph separators (U+2028, U+2029), lone surrogates (not
    UTF-8), Unicode noncharacters (systemd refuses them as invalid UTF-8) and bidirectional overrides."""
    for c in text:
        o = ord(c)
        if 0x20 <= o < 0x7F:
            continue
        if o < 0x20 or 0x7F <= o <= 0x9F or _noncharacter(o) or c in _BIDI:
            return c
        if unicodedata.category(c) in ("Zl", "Zp", "Cs"):
            return c
    return None


_CONTROL_NAMES = {0x00: "NUL", 0x07: "BELL", 0x08: "BACKSPACE", 0x09: "TAB", 0x0A: "LINE FEED", 0x0B: "VERTICAL TAB",
                  0x0C: "FORM FEED", 0x0D: "CARRIAGE RETURN", 0x1B: "ESCAPE", 0x7F: "DELETE", 0x85: "NEXT LINE",
                  0x9B: "CONTROL SEQUENCE INTRODUCER"}


def describe(c: str) -> str:
    """A character named for a message: 'U+001B (ESCAPE)'."""
    name = _CONTROL_NAMES.get(ord(c)) or unicodedata.name(c, "")
    return f"U+{ord(c):04X}" + (f" ({name})" if name else "")
