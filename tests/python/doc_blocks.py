"""The ```python blocks of README.md and docs/*.md, for tests that run them as written.

A test takes a block by a line it contains, fills its placeholders (``...`` lines, paths,
sizes) through ``substitute``, which fails when a substitution no longer matches exactly
once: a block edited in the docs breaks its test instead of silently testing old text.
"""

from __future__ import annotations

import re
import shlex
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


def substitute(block: Block, *pairs: tuple[str, str] | tuple[str, str, int]) -> str:
    """The block's code with each (old, new) replaced; each `old` must occur exactly once, or
    exactly n times for an (old, new, n) triple (a path the block names several times)."""
    code = block.code
    for old, new, *times in pairs:
        want = times[0] if times else 1
        count = code.count(old)
        assert count == want, f"{block}: {old!r} occurs {count} times, not {want} (the docs " \
            "changed?)"
        code = code.replace(old, new)
    return code


def run_block(block: Block, code: str, namespace: dict) -> dict:
    """Executes `code` (the block's, substituted) in `namespace`, in this process; a traceback
    names the block's file and line."""
    exec(compile(code, str(block), "exec"), namespace)  # noqa: S102 -- the docs' own code
    return namespace


def shell_command(path: Path, text: str) -> list[str]:
    """The one command of a ```bash block of `path` that contains `text`, as argv: its
    continuation lines joined, its trailing comment dropped."""
    found = []
    inside = False
    command = ""
    for line in path.read_text().splitlines():
        if not inside:
            inside = bool(re.match(r"^```(bash|sh)\s*$", line))
            continue
        if line.startswith("```"):
            inside = False
            continue
        command += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            if text in command:
                found.append(command)
            command = ""
    assert len(found) == 1, f"{len(found)} bash commands of {path} contain {text!r}"
    return shlex.split(found[0], comments=True)


def code_lines(text: str) -> list[str]:
    """Lines without indentation, trailing comments and blank lines (for comparing a block
    with the example script it shows)."""
    out = []
    for line in text.splitlines():
        line = line.split("  #")[0].split("# ")[0] if "#" in line else line
        if line.strip():
            out.append(line.strip())
    return out


try:  # tests/python/machine.py: deadlines that follow this machine's speed and load
    from machine import deadline, startup
except ImportError:  # (not in every checkout yet)
    def deadline(seconds: float) -> float:
        """`seconds` of work on an idle 2-core machine, with room for a loaded one."""
        return 3.0 * seconds

    def startup(processes: int = 1) -> float:
        """Seconds for `processes` Python processes that import torch to start."""
        return deadline(1.0 + 2.5 * max(1.0, processes / 2))
