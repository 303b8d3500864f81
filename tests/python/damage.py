"""Damaging checkpoint files on purpose, for the tests of what reads them."""

from __future__ import annotations


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> None:
    """XORs the byte of `path` at `offset` with `mask` (in place; a second call undoes it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
