"""A small RGB canvas that writes PNG files with the standard library alone (rectangles and a 5x7 bitmap font).

Enough to draw timelines without a plotting library: :class:`Canvas` fills rectangles and writes upper-case text;
:meth:`Canvas.png` encodes the image (zlib + CRC-checked chunks, as the PNG specification lays them out).
"""

from __future__ import annotations

import os
import struct
import zlib

__all__ = ["Canvas", "Color"]

Color = tuple[int, int, int]

# 5x7 glyphs: seven rows, each a byte whose low five bits are the row's pixels (bit 4 = leftmost)
_GLYPHS = {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f", "3": "1f02040201110e",
    "4": "02060a121f0202", "5": "1f101e0101110e", "6": "0608101e11110e", "7": "1f010204080808",
    "8": "0e11110e11110e", "9": "0e11110f01020c", "A": "0e11111f111111", "B": "1e11111e11111e",
    "C": "0e11101010110e", "D": "1c12111111121c", "E": "1f10101e10101f", "F": "1f10101e101010",
    "G": "0e11101711110f", "H": "1111111f111111", "I": "0e04040404040e", "J": "0702020202120c",
    "K": "11121418141211", "L": "1010101010101f", "M": "111b1515111111", "N": "11111915131111",
    "O": "0e11111111110e", "P": "1e11111e101010", "Q": "0e11111115120d", "R": "1e11111e141211",
    "S": "0f10100e01011e", "T": "1f040404040404", "U": "1111111111110e", "V": "11111111110a04",
    "W": "1111111515150a", "X": "11110a040a1111", "Y": "1111110a040404", "Z": "1f01020408101f",
    ".": "00000000000c0c", ",": "000000000c0408", ":": "000c0c000c0c00", "-": "0000001f000000",
    "+": "0004041f040400", "=": "00001f001f0000", "%": "18190204081303", "(": "02040808080402",
    ")": "08040202020408", "/": "00010204081000", "_": "0000000000001f",
}
GLYPH_WIDTH, GLYPH_HEIGHT = 6, 7
"""Advance per character (5 pixels and a gap) and the glyphs' height, at scale 1."""


class Canvas:
    """An RGB image, white to begin with.

    Args:
        width: Pixels across.
        height: Pixels down.
    """

    def __init__(self, width: int, height: int) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"a canvas needs at least one pixel, got {width} x {height}")
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """Fills the pixels from ``(x0, y0)`` up to, not including, ``(x1, y1)`` (clipped to the canvas)."""
        left, right = max(0, int(round(x0))), min(self.width, int(round(x1)))
        top, bottom = max(0, int(round(y0))), min(self.height, int(round(y1)))
        if right <= left or bottom <= top:
            return
        row = bytes(color) * (right - left)
        for y in range(top, bottom):
            start = (y * self.width + left) * 3
            self.pixels[start : start + len(row)] = row

    def text(self, x: float, y: float, text: str, color: Color = (0, 0, 0), scale: int = 1) -> float:
        """Writes ``text`` (upper-cased; characters without a glyph are left blank) from its top-left corner.

        Returns:
            The x after the text.
        """
        x, y = int(round(x)), int(round(y))
        for char in text.upper():
            glyph = _GLYPHS.get(char)
            if glyph is not None:
                for row in range(GLYPH_HEIGHT):
                    bits = int(glyph[2 * row : 2 * row + 2], 16)
                    for column in range(5):
                        if bits & (0x10 >> column):
                            px, py = x + column * scale, y + row * scale
                            self.rect(px, py, px + scale, py + scale, color)
            x += GLYPH_WIDTH * scale
        return x

    @staticmethod
    def text_width(text: str, scale: int = 1) -> int:
        """Pixels ``text`` takes across."""
        return len(text) * GLYPH_WIDTH * scale

    def png(self) -> bytes:
        """The image as a PNG file (8-bit RGB, no interlace)."""
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(
            b"IEND", b"")

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`png` to ``path``."""
        with open(path, "wb") as file:
            file.write(self.png())


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
