"""The ```python blocks of README.md and docs/*.md, for tests that run them as written.

A test takes a block by a line it contains, fills its placeholders (``...`` lines, paths,
sizes) through ``substitute``, which fails when a substitution no longer matches exactly
once: a block edited in the docs breaks its test instead of silently testing old text.
``run_block`` runs one in this process; ``Job`` runs a script made of ``RANK_PRELUDE``, a
prelude, the block and an ending on several ranks, the job's store hosted by the test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
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


# -- running a block on several ranks --------------------------------------------------------
RANK_PRELUDE = '''
import json, os, signal, sys
from datetime import timedelta
import torch
import torch.distributed as dist

torch.set_num_threads(1)
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
OUT = os.environ["DOC_OUT"]


def job_store():
    """A client of the job's store (hosted by the test, as by torchrun's agent)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=60))


def die():
    """This rank is lost: SIGKILL, as kill -9."""
    os.kill(os.getpid(), signal.SIGKILL)


def report(**values):
    """This rank's results for the test, then exit (no destructors: a failed gloo group's
    threads may still wait for the lost rank)."""
    path = os.path.join(OUT, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(values, f, default=str)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
'''


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test's process dies (a killed pytest leaves no rank)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Job:
    """`world` processes of `script`, with torchrun's environment for env:// (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT and TORCHELASTIC_USE_AGENT_STORE: every rank is a client of
    the store this test hosts). Each rank's output goes to rank<R>.log, its report to
    rank<R>.json in `out`. Every process group is SIGKILLed on exit."""

    def __init__(self, out: Path, script: str, world: int, env: dict | None = None) -> None:
        import torch.distributed as dist

        self.out, self.world = out, world
        out.mkdir(parents=True, exist_ok=True)
        (out / "script.py").write_text(script)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "DOC_OUT": str(out), "OMP_NUM_THREADS": "1",
                    "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Job:
        for r in range(self.world):
            with open(self.out / f"rank{r}.log", "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(self.out / "script.py")], stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
                    env={**self.env, "RANK": str(r), "LOCAL_RANK": str(r),
                         "GROUP_RANK": "0"}))
        return self

    def wait(self, seconds: float) -> list[int | None]:
        """Each rank's exit code, waiting up to `seconds` in all (None: still running)."""
        end = time.monotonic() + seconds
        for p in self.procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def report(self, r: int) -> dict:
        path = self.out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report:\n{self.logs()}"
        return json.loads(path.read_text())

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}:\n" + (self.out / f"rank{r}.log").read_text()[-3000:]
                         for r in range(self.world) if (self.out / f"rank{r}.log").exists())

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)
