"""Test tiers, from each file's name, and what a tier may do (a pytest plugin; conftest loads it).

- ``unit``: ``test_<thing>.py``. In-process: no Python child process (a script, torchrun,
  ``resilient run``), no multiprocessing, no server. Fast, and safe to run many at once.
- ``multiproc``: ``test_<thing>_multiproc.py``. Starts ranks or scripts (torch.multiprocessing,
  subprocesses of Python), kills or freezes them; no server and no launcher.
- ``system``: ``test_<thing>_system.py``. Real servers (etcd, SeaweedFS), network namespaces,
  ``resilient run`` end to end, chaos runs.

Every test gets its tier's marker (``-m unit``, ``-m "multiproc or system"``), so no test lands
untiered, and a guard fails a test that does more than its tier allows, naming the file name to
move it to. A failed multiproc or system test that ran while the machine's tasks waited for a
CPU most of the time is reported as CPU-starved (a deadline can fail for want of CPU, which
says nothing of the product): its report carries the share of time the CPU was contended.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import machine

TIERS = ("unit", "multiproc", "system")
#: Programs that make a test a system test (servers, network namespaces, load generators);
#: `resilient run` and `resilient chaos` do too, however they are started.
SYSTEM_PROGRAMS = ("etcd", "weed", "ip", "unshare", "nsenter", "stress-ng")
SYSTEM_COMMANDS = ("run", "chaos")
SYSTEM_MODULES = ("resilient.run", "resilient.chaos")
#: A CPU-contention share above which a failed test is reported as starved.
STARVED = 0.5


def tier_of(path: Any) -> str:
    stem = Path(str(path)).stem
    if stem.endswith("_system"):
        return "system"
    if stem.endswith("_multiproc"):
        return "multiproc"
    return "unit"


def _program(args: Any) -> tuple[str, list[str]]:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in argv]
    if len(argv) == 1 and " " in argv[0]:  # shell=True or a command line
        argv = argv[0].split()
    return (os.path.basename(argv[0]) if argv else ""), argv


def _is_python(name: str, argv: list[str]) -> bool:
    return (name.startswith("python") or (argv and os.path.realpath(argv[0]) ==
                                           os.path.realpath(sys.executable))
            or name in ("torchrun", "pytest"))


def _needs(tier: str, args: Any) -> str | None:
    """The tier that starting `args` needs beyond `tier`, or None when `tier` allows it."""
    name, argv = _program(args)
    module = argv[2] if _is_python(name, argv) and argv[1:2] == ["-m"] and len(argv) > 2 else ""
    resilient_cli = name == "resilient" or module in ("resilient", "resilient.cli") or (
        _is_python(name, argv) and "resilient.cli" in " ".join(argv[1:3]))
    system = (name in SYSTEM_PROGRAMS or module.startswith(SYSTEM_MODULES)
              or (resilient_cli and any(a in SYSTEM_COMMANDS for a in argv[1:5])))
    if system and tier != "system":
        return "system"
    if tier == "unit" and (_is_python(name, argv) or resilient_cli):
        return "multiproc"
    return None


def _refuse(item: pytest.Item, needs: str, what: str) -> None:
    stem = Path(str(item.path)).stem
    for suffix in ("_multiproc", "_system"):
        stem = stem.removesuffix(suffix)
    pytest.fail(f"{item.nodeid} is a {tier_of(item.path)} test but starts {what}, which a "
                f"{needs} test does: move it to {stem}_{needs}.py (tests/python/tiers.py)",
                pytrace=False)


@contextlib.contextmanager
def _tier_guard(item: pytest.Item) -> Iterator[None]:
    """While `item` sets up (its fixtures, module- and session-scoped ones included) and runs:
    starting a program or process its tier does not allow fails it."""
    tier = tier_of(item.path)
    if tier == "system":
        yield
        return
    popen_init = subprocess.Popen.__init__
    start = multiprocessing.process.BaseProcess.start

    def guarded_popen(self: Any, args: Any, *a: Any, **k: Any) -> None:
        needs = _needs(tier, args)
        if needs is not None:
            _refuse(item, needs, f"the program {_program(args)[1][:3]}")
        popen_init(self, args, *a, **k)

    def guarded_start(self: Any) -> None:
        if tier == "unit":
            _refuse(item, "multiproc", f"a {type(self).__name__}")
        start(self)

    subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with _tier_guard(item):
        yield


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a {tier}-tier test (tests/python/tiers.py)")
    config.addinivalue_line("markers", "alone: measures time in steps or ratios that the machine's "
                            "load would decide: scripts/test.sh runs these after the parallel "
                            "runs, one at a time")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    item.stash[_STALL] = (machine.stall_counter(), time.monotonic())
    with _tier_guard(item):
        yield
    before, t0 = item.stash[_STALL]
    seconds = time.monotonic() - t0
    item.stash[_SHARE] = (machine.stall_share(before, machine.stall_counter(), seconds), seconds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or tier_of(item.path) == "unit":
        return
    share, seconds = item.stash.get(_SHARE, (None, 0.0))
    if share is None:
        return
    text = (f"the machine's tasks waited for a CPU {share:.0%} of this test's {seconds:.1f} s "
            f"(load average {os.getloadavg()[0]:.1f} on {machine.cores()} cores)")
    if share >= STARVED:
        report.sections.append(("CPU-starved", f"CPU-STARVED: {text}: a deadline may have "
                                "failed for want of CPU, not because of the code under test"))
        report.user_properties.append(("cpu_starved", round(share, 3)))
    else:
        report.sections.append(("CPU", text))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    starved = [r for r in terminalreporter.stats.get("failed", [])
               if any(k == "cpu_starved" for k, _ in getattr(r, "user_properties", []))]
    if starved:
        terminalreporter.section("CPU-starved failures")
        for r in starved:
            share = dict(r.user_properties)["cpu_starved"]
            terminalreporter.line(f"{r.nodeid}: failed while tasks waited for a CPU "
                                  f"{share:.0%} of its time; run it again on a quieter machine "
                                  "before reading it as a product failure")


_STALL = pytest.StashKey[tuple]()
_SHARE = pytest.StashKey[tuple]()
