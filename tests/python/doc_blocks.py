"""The ```python blocks of README.md and docs/*.md, for tests that run them as written.

A test takes a block by a line it contains, fills its placeholders (``...`` lines, paths,
sizes) through ``substitute``, which fails when a substitution no longer matches exactly
once: a block edited in the docs breaks its test instead of silently testing old text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """Every ```python block of a Markdown file, in order."""
    blocks, lines, start = [], [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if start is None and re.match(r"^```python\s*$", line):
            start, lines = n, []
        elif start is not None and line.startswith("```"):
            blocks.append(Block(path, start, "\n".join(lines) + "\n"))
            start = None
        elif start is not None:
            lines.append(line)
    return blocks


def block_with(path: Path, text: str) -> Block:
    """The one python block of `path` that contains `text`."""
    found = [b for b in python_blocks(path) if text in b.code]
    assert len(found) == 1, f"{len(found)} python blocks of {path} contain {text!r}"
    return found[0]


def substitute(block: Block, *pairs: tuple[str, str]) -> str:
    """The block's code with each (old, new) replaced; each `old` must occur exactly once."""
    code = block.code
    for old, new in pairs:
        count = code.count(old)
        assert count == 1, f"{block}: {old!r} occurs {count} times (the docs changed?)"
        code = code.replace(old, new)
    return code


def code_lines(text: str) -> list[str]:
    """Lines without indentation, trailing comments and blank lines (for comparing a block
    with the example script it shows)."""
    out = []
    for line in text.splitlines():
        line = line.split("  #")[0].split("# ")[0] if "#" in line else line
        if line.strip():
            out.append(line.strip())
    return out
