"""A tiny grouped bar chart written as PNG with the standard library only (zlib + struct), no matplotlib.

Text is drawn with a built-in 5x7 pixel font (upper case, digits and a little punctuation; lower case is drawn
as upper case). Enough for labels such as `ftllm-dflash @ r2026.11` and values such as `156.0`.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from deploy_tool.fsutil import atomic_write

RGB = tuple[int, int, int]

_FONT: dict[str, tuple[str, ...]] = {
    "0": ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    "1": ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    "2": ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    "3": ("11110", "00001", "00001", "01110", "00001", "00001", "11110"),
    "4": ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    "5": ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    "6": ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    "7": ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    "8": ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    "9": ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
    "A": ("01110", "10001", "10001", "11111", "10001", "10001", "10001"),
    "B": ("11110", "10001", "10001", "11110", "10001", "10001", "11110"),
    "C": ("01110", "10001", "10000", "10000", "10000", "10001", "01110"),
    "D": ("11100", "10010", "10001", "10001", "10001", "10010", "11100"),
    "E": ("11111", "10000", "10000", "11110", "10000", "10000", "11111"),
    "F": ("11111", "10000", "10000", "11110", "10000", "10000", "10000"),
    "G": ("01110", "10001", "10000", "10111", "10001", "10001", "01111"),
    "H": ("10001", "10001", "10001", "11111", "10001", "10001", "10001"),
    "I": ("01110", "00100", "00100", "00100", "00100", "00100", "01110"),
    "J": ("00111", "00010", "00010", "00010", "00010", "10010", "01100"),
    "K": ("10001", "10010", "10100", "11000", "10100", "10010", "10001"),
    "L": ("10000", "10000", "10000", "10000", "10000", "10000", "11111"),
    "M": ("10001", "11011", "10101", "10101", "10001", "10001", "10001"),
    "N": ("10001", "10001", "11001", "10101", "10011", "10001", "10001"),
    "O": ("01110", "10001", "10001", "10001", "10001", "10001", "01110"),
    "P": ("11110", "10001", "10001", "11110", "10000", "10000", "10000"),
    "Q": ("01110", "10001", "10001", "10001", "10101", "10010", "01101"),
    "R": ("11110", "10001", "10001", "11110", "10100", "10010", "10001"),
    "S": ("01111", "10000", "10000", "01110", "00001", "00001", "11110"),
    "T": ("11111", "00100", "00100", "00100", "00100", "00100", "00100"),
    "U": ("10001", "10001", "10001", "10001", "10001", "10001", "01110"),
    "V": ("10001", "10001", "10001", "10001", "10001", "01010", "00100"),
    "W": ("10001", "10001", "10001", "10101", "10101", "10101", "01010"),
    "X": ("10001", "10001", "01010", "00100", "01010", "10001", "10001"),
    "Y": ("10001", "10001", "01010", "00100", "00100", "00100", "00100"),
    "Z": ("11111", "00001", "00010", "00100", "01000", "10000", "11111"),
    " ": ("00000",) * 7,
    ".": ("00000", "00000", "00000", "00000", "00000", "01100", "01100"),
    ",": ("00000", "00000", "00000", "00000", "01100", "00100", "01000"),
    "-": ("00000", "00000", "00000", "11111", "00000", "00000", "00000"),
    "_": ("00000", "00000", "00000", "00000", "00000", "00000", "11111"),
    "+": ("00000", "00100", "00100", "11111", "00100", "00100", "00000"),
    "/": ("00001", "00010", "00010", "00100", "01000", "01000", "10000"),
    ":": ("00000", "01100", "01100", "00000", "01100", "01100", "00000"),
    "%": ("11001", "11010", "00010", "00100", "01000", "01011", "10011"),
    "(": ("00010", "00100", "01000", "01000", "01000", "00100", "00010"),
    ")": ("01000", "00100", "00010", "00010", "00010", "00100", "01000"),
    "@": ("01110", "10001", "10111", "10101", "10111", "10000", "01110"),
    "~": ("00000", "00000", "01000", "10101", "00010", "00000", "00000"),
    "!": ("00100", "00100", "00100", "00100", "00100", "00000", "00100"),
    "=": ("00000", "00000", "11111", "00000", "11111", "00000", "00000"),
    "?": ("01110", "10001", "00001", "00010", "00100", "00000", "00100"),
}

PALETTE: tuple[RGB, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                            (140, 86, 75), (227, 119, 194), (127, 127, 127))
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
GREY: RGB = (200, 200, 200)


class Canvas:
    """An RGB pixel buffer with rectangles and 5x7 text; `png()` encodes it."""

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width = width
        self.height = height
        self.px = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x0 >= x1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.width + x0) * 3
            self.px[i:i + len(row)] = row

    def pixel(self, x: int, y: int) -> RGB:
        i = (y * self.width + x) * 3
        return (self.px[i], self.px[i + 1], self.px[i + 2])

    def text(self, x: int, y: int, s: str, color: RGB = BLACK, scale: int = 2) -> int:
        """Draw `s` with its top-left corner at (x, y); returns the width drawn."""
        cx = x
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT["?"])
            for gy, bits in enumerate(glyph):
                for gx, bit in enumerate(bits):
                    if bit == "1":
                        self.rect(cx + gx * scale, y + gy * scale, cx + (gx + 1) * scale, y + (gy + 1) * scale,
                                  color)
            cx += 6 * scale
        return cx - x

    def png(self) -> bytes:
        raw = bytearray()
        stride = self.width * 3
        for y in range(self.height):
            raw.append(0)  # filter: none
            raw += self.px[y * stride:(y + 1) * stride]
        return encode_png(self.width, self.height, bytes(raw))


def text_width(s: str, scale: int = 2) -> int:
    return len(s) * 6 * scale


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, filtered_rows: bytes) -> bytes:
    """An 8-bit RGB PNG from rows that each start with a filter byte."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(filtered_rows, 9))
            + _chunk(b"IEND", b""))


def nice_top(v: float) -> float:
    """The smallest 4 x (1, 2, 2.5 or 5 x 10^k) that is at least `v`: the axis top with round grid steps."""
    step = v / 4
    mag = 10 ** math.floor(math.log10(step))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= step - 1e-12:
            return 4 * m * mag
    return 4 * 10 * mag  # pragma: no cover


def bar_chart(groups: Sequence[tuple[str, Mapping[str, float | None]]], *, title: str = "",
              unit: str = "", series: Sequence[str] | None = None) -> bytes:
    """A grouped bar chart as PNG bytes: one group per (label, {series: value}), one colour per series."""
    names = list(series) if series else list(dict.fromkeys(k for _, vals in groups for k in vals))
    values = [v for _, vals in groups for v in vals.values() if v is not None]
    vmax = nice_top(max(values) * 1.1 if values and max(values) > 0 else 1.0)
    bar_w, gap = 34, 30
    group_w = max(1, len(names)) * bar_w
    label_w = max([text_width(lbl, 1) for lbl, _ in groups] + [0])
    left, top, bottom = 70, 60, 50
    plot_w = max(len(groups), 1) * (group_w + gap) + gap
    width = max(left + plot_w + 20, left + label_w + 40, 360)
    plot_h = 300
    height = top + plot_h + bottom + 20
    c = Canvas(width, height)
    if title:
        c.text(10, 10, title, scale=2)
    if unit:
        c.text(10, 34, unit, scale=1)
    x_leg = 10 + text_width(unit, 1) + 20 if unit else 10
    for i, name in enumerate(names):  # legend
        col = PALETTE[i % len(PALETTE)]
        c.rect(x_leg, 33, x_leg + 10, 43, col)
        x_leg += 14 + c.text(x_leg + 14, 35, name, scale=1) + 10
    y0 = top + plot_h  # baseline
    for k in range(5):  # grid and axis values
        v = vmax * k / 4
        y = y0 - int(plot_h * k / 4)
        c.rect(left, y, left + plot_w, y + 1, GREY)
        lbl = f"{v:g}"
        c.text(left - 6 - text_width(lbl, 1), y - 3, lbl, scale=1)
    c.rect(left, top, left + 1, y0 + 1, BLACK)
    c.rect(left, y0, left + plot_w, y0 + 1, BLACK)
    for g, (label, vals) in enumerate(groups):
        gx = left + gap + g * (group_w + gap)
        for i, name in enumerate(names):
            val = vals.get(name)
            if val is None:
                continue
            h = int(plot_h * max(val, 0.0) / vmax)
            x = gx + i * bar_w
            c.rect(x + 2, y0 - h, x + bar_w - 2, y0, PALETTE[i % len(PALETTE)])
            vl = f"{val:.0f}" if val >= 100 else f"{val:.1f}"
            c.text(x + (bar_w - text_width(vl, 1)) // 2, y0 - h - 10, vl, scale=1)
        lx = gx + (group_w - text_width(label, 1)) // 2
        c.text(max(2, min(lx, width - text_width(label, 1) - 2)), y0 + 8 + (g % 2) * 12, label, scale=1)
    return c.png()


def write_bar_chart(path: str | os.PathLike[str], groups: Sequence[tuple[str, Mapping[str, float | None]]],
                    **kw: object) -> Path:
    """Write `bar_chart(groups, **kw)` to `path` atomically."""
    p = Path(path)
    atomic_write(p, bar_chart(groups, **kw))  # type: ignore[arg-type]
    return p


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB pixels) of a PNG this module wrote (filter 0 rows only); used to check charts."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        if zlib.crc32(tag + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"bad CRC in {tag!r}")
        if tag == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * 3 + 1
    return w, h, b"".join(raw[y * stride + 1:(y + 1) * stride] for y in range(h))
