"""resilient.settings: one table, parsed like the C++ core parses it, documented from itself;
lists parsed as lists, every number checked against its range naming the variable."""


from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from resilient import _C, settings
from resilient.recovery import RecoveryConfig

REPO = Path(__file__).resolve().parents[3]


# Variables that pass values between resilient's own processes (chaos runner -> job); not
# settings a user sets.
INTERNAL = {"RESILIENT_CHAOS_ATTEMPT", "RESILIENT_CHAOS_CKPT_DIR", "RESILIENT_CHAOS_STORE",
            # resilient run -> its workers
            "RESILIENT_LAUNCHER", "RESILIENT_JOIN", "RESILIENT_JOIN_FOR_RANK",
            "RESILIENT_JOIN_WORLD", "RESILIENT_JOIN_STORE", "RESILIENT_RUN_STATE",
            "RESILIENT_LAUNCH_ID", "RESILIENT_STORE_LEASE",
            # testing: stops a tier copy at a stage (test_tiers kills it there)
            "RESILIENT_TIER_PAUSE_AT"}


def test_the_settings_document_is_generated_from_the_table():
    assert (REPO / "docs/SETTINGS.md").read_text() == settings.describe(), (
        "docs/SETTINGS.md is out of date: resilient settings > docs/SETTINGS.md")


def test_every_variable_the_code_reads_is_in_the_table():
    quoted = re.compile(r'"(RESILIENT_[A-Z0-9_]*[A-Z0-9])"')
    read = set()
    for root in ("cpp", "bindings", "python/resilient"):
        for path in (REPO / root).rglob("*"):
            if path.suffix in (".py", ".cpp", ".hpp"):
                read.update(quoted.findall(path.read_text()))
    # names built from a prefix: RESILIENT_RECOVERY_<FIELD>
    read.update(f"RESILIENT_RECOVERY_{f.name.upper()}" for f in dataclasses.fields(RecoveryConfig))
    assert sorted(read - set(settings.SETTINGS) - INTERNAL) == []


def test_recovery_defaults_agree_with_the_table():
    cfg = RecoveryConfig()
    for f in dataclasses.fields(RecoveryConfig):
        assert settings.get(f"RESILIENT_RECOVERY_{f.name.upper()}") == getattr(cfg, f.name), f.name


def test_get_set_and_restore(monkeypatch):
    monkeypatch.delenv("RESILIENT_IO_URING", raising=False)
    assert settings.get("io_uring") == "auto"
    with settings.set(io_uring="OFF", ckpt_timeout_s=30, chunk_bytes="4MiB"):
        assert os.environ["RESILIENT_IO_URING"] == "OFF"
        assert settings.get("RESILIENT_IO_URING") == "off"
        assert settings.get("ckpt_timeout_s") == 30.0
        assert settings.get("CHUNK_BYTES") == 4 << 20
    assert "RESILIENT_IO_URING" not in os.environ
    assert settings.get("metrics_port") is None  # unset, no fixed default
    assert settings.get_or("metrics_port", 0) == 0


def test_set_checks_everything_before_changing_anything(monkeypatch):
    monkeypatch.delenv("RESILIENT_ZSTD_LEVEL", raising=False)
    with pytest.raises(ValueError, match="RESILIENT_IO_URING='sometimes'"):
        settings.set(zstd_level=3, io_uring="sometimes")
    assert "RESILIENT_ZSTD_LEVEL" not in os.environ
    with pytest.raises(KeyError, match="unknown setting"):
        settings.set(no_such_thing=1)


@pytest.mark.parametrize("name,bad", [
    ("RESILIENT_RECOVERY_PREFER_SHRINK", "garbage"),
    ("RESILIENT_CHECK_REPLICAS", "maybe"),
    ("RESILIENT_DIST_TIMEOUT_S", "10 minutes"),
    ("RESILIENT_DIST_SPLIT_BYTES", "lots"),
    ("RESILIENT_DIST_RESTORE", "sometimes"),
    ("RESILIENT_IO_URING", "perhaps"),
    ("RESILIENT_METRICS_PORT", "80a"),
])
def test_a_malformed_value_is_an_error_naming_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        settings.get(name)


def test_recovery_booleans_no_longer_mean_false_for_anything(monkeypatch):
    monkeypatch.setenv("RESILIENT_RECOVERY_PREFER_SHRINK", "yes")
    assert RecoveryConfig.from_env().prefer_shrink is True
    monkeypatch.setenv("RESILIENT_RECOVERY_PREFER_SHRINK", "garbage")
    with pytest.raises(ValueError, match="RESILIENT_RECOVERY_PREFER_SHRINK"):
        RecoveryConfig.from_env()
    with pytest.raises(ValueError, match="must be a bool"):
        RecoveryConfig().set("prefer_shrink", 1)


def test_a_checkpointer_refuses_a_malformed_setting(tmp_path, monkeypatch):
    from resilient import Checkpointer

    monkeypatch.setenv("RESILIENT_CHECK_REPLICAS", "perhaps")
    with pytest.raises(ValueError, match="RESILIENT_CHECK_REPLICAS"):
        Checkpointer(tmp_path / "c", create=True)


# -- lists (issue 50 item 5) ---------------------------------------------------------------
LISTS = sorted(name for name, s in settings.SETTINGS.items() if s.kind == "list")


_ITEM = {"RESILIENT_TIERS": ["/mnt/shared/ckpt", "s3://bucket/run42", "/tmp/t"],
         "RESILIENT_FAULT_OPS": ["write", "fsync", "rename"]}


def test_every_list_setting_has_examples_here():
    assert LISTS == sorted(_ITEM), "a new list setting: add its items to _ITEM"


@pytest.mark.parametrize("name", LISTS)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_a_list_setting_is_its_items_with_one_or_several(monkeypatch, name, count):
    items = _ITEM[name][:count]
    monkeypatch.setenv(name, " , ".join(items))
    assert settings.get(name) == items
    with settings.set({name: items}):
        assert settings.get(name) == items


@pytest.mark.parametrize("name", LISTS)
@pytest.mark.parametrize("text", [",", "a,,b", "a,", ",a"])
def test_a_list_with_an_empty_item_is_refused(monkeypatch, name, text):
    first = _ITEM[name][0]
    monkeypatch.setenv(name, text.replace("a", first).replace("b", first))
    with pytest.raises(ValueError, match=f"{name}=.*empty item"):
        settings.get(name)


def test_fault_ops_items_are_checked():
    with pytest.raises(ValueError, match="RESILIENT_FAULT_OPS='write,fsnyc': unknown item 'fsnyc'"):
        settings.lookup("fault_ops").parse("write,fsnyc")


def test_tiers_from_the_environment_are_two_tiers_not_one_per_character(tmp_path, monkeypatch):
    """RESILIENT_TIERS=a,b: each step reaches both tiers; nothing lands in the working
    directory (it used to become one file tier per character of the value)."""
    import torch

    from resilient import Checkpointer

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    a, b = tmp_path / "tier-a", tmp_path / "tier-b"
    monkeypatch.setenv("RESILIENT_TIERS", f"{a},{b}")
    with Checkpointer(tmp_path / "local", create=True, distributed=False) as ck:
        assert [t.path for t in ck._tiers] == [str(a), str(b)]
        ck.save(1, {"w": torch.arange(4.0)}).wait()
    for tier in (a, b):
        assert _C.committed_steps(str(tier)) == [1], tier
    assert os.listdir(cwd) == []


# -- ranges (issue 50 item 13, issue 44 item 10) --------------------------------------------
NUMBERS = sorted(n for n, s in settings.SETTINGS.items() if s.kind in ("int", "float", "bytes"))


@pytest.mark.parametrize("name", NUMBERS)
def test_every_number_has_a_range_its_default_is_in(name):
    s = settings.SETTINGS[name]
    assert s.range is not None, f"{name}: give it a range in settings.toml"
    if s.default is not None:
        s.parse(s.default)  # raises if the default is outside


def _edges(s: settings.Setting) -> list[tuple[str, bool]]:
    """(text, inside the range) just inside and just outside each finite bound."""
    r, out = s.range, []
    step = 1 if s.kind in ("int", "bytes") else 1e-3
    for bound, closed, outward in ((r.low, r.low_closed, -1), (r.high, r.high_closed, 1)):
        if bound in (math.inf, -math.inf):
            continue
        inside = bound if closed else bound - outward * step
        outside = bound + outward * step if closed else bound
        for value, ok in ((inside, True), (outside, False)):
            if s.kind == "bytes" and value < 0:
                continue  # not a size at all
            if s.multiple and value % s.multiple:
                value = value - value % s.multiple + (s.multiple if outward > 0 and not ok
                                                      else 0)
            out.append((repr(int(value)) if step == 1 else repr(value), ok))
    return out


@pytest.mark.parametrize("name", NUMBERS)
def test_values_outside_the_range_are_refused_naming_the_variable(name, monkeypatch):
    s = settings.SETTINGS[name]
    for text, ok in _edges(s):
        monkeypatch.setenv(name, text)
        if ok:
            settings.get(name)
        else:
            with pytest.raises(ValueError, match=f"^{name}='{re.escape(text)}': must be"):
                settings.get(name)


@pytest.mark.parametrize("name,text,reason", [
    ("RESILIENT_CHUNK_BYTES", "5k", "must be a multiple of 4KiB"),
    ("RESILIENT_ZSTD_LEVEL", "23", r"must be in \[0, 22\]"),
    ("RESILIENT_FILES_PER_RANK", "0", r"must be in \[1, 64\]"),
    ("RESILIENT_THREADS", "0", r"must be in \[1, 1024\]"),
    ("RESILIENT_THREADS", "-3", r"must be in \[1, 1024\]"),
    ("RESILIENT_CKPT_TIMEOUT_S", "0", "must be > 0"),
    ("RESILIENT_DIST_TIMEOUT_S", "-1", "must be > 0"),
    ("RESILIENT_COLLECTIVE_TIMEOUT_S", "0", "must be > 0"),
    ("RESILIENT_RECOVERY_GROUP_TIMEOUT_S", "-1", "must be > 0"),
    ("RESILIENT_LOG_LEVEL", "verbose", "expected one of debug, info, warn, error"),
    ("RESILIENT_FAULT_ERRNO", "EBOGUS", "unknown errno"),
    ("RESILIENT_FAULT_ERRNO", "-5", "unknown errno"),
    ("RESILIENT_BACKGROUND_CPUS", "4-2", "bad part '4-2'"),
    ("RESILIENT_BACKGROUND_CPUS", "0,", "bad part ''"),
    ("RESILIENT_DETECT_HOST", "10.0.0", "expected an IPv4 address"),
])
def test_the_issues_examples_are_refused_naming_the_variable(monkeypatch, name, text, reason):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=f"^{name}='{re.escape(text)}': {reason}"):
        settings.get(name)


def test_errno_names_and_numbers():
    s = settings.lookup("fault_errno")
    assert (s.parse("ENOSPC"), s.parse("28"), s.parse("0")) == (errno.ENOSPC, 28, 0)


# Native readers of the environment (from_env, then validate), by variable.
def _checkpoint_engine() -> None:
    with tempfile.TemporaryDirectory() as d:
        opts = _C.CheckpointOptions(d)
        opts.keep = 0
        _C.Checkpointer(opts).close(None)


def _straggler() -> None:
    _C.straggler.StragglerOptions.from_env().validate()


_NATIVE = {
    **dict.fromkeys(["CHUNK_BYTES", "ZSTD_LEVEL", "COPY_THREADS", "RESTORE_THREADS",
                     "FILES_PER_RANK", "COPY_STREAMS", "BACKGROUND_NICE", "CKPT_TIMEOUT_S",
                     "IO_REQUEST_BYTES", "IO_QUEUE_DEPTH", "IO_THREADS", "POOL_SLAB_BYTES",
                     "POOL_BYTES"], _checkpoint_engine),
    **dict.fromkeys(["COMM_INIT_TIMEOUT_S", "COMM_COLLECTIVE_TIMEOUT_S",
                     "COMM_QUIESCE_TIMEOUT_S", "COMM_STORE_TIMEOUT_S", "COMM_POLL_INTERVAL_US"],
                    lambda: _C.comm.CommOptions.from_env()),
    **dict.fromkeys([n[len("RESILIENT_"):] for n in NUMBERS if "_STRAGGLER_" in n
                     and not n.endswith("EXCHANGE_TIMEOUT_S")], _straggler),
    **dict.fromkeys(["DETECT_HEARTBEAT_MS", "DETECT_WATCH_COUNT", "DETECT_PHI_THRESHOLD",
                     "DETECT_ACCEPTABLE_PAUSE_MS", "DETECT_MIN_STDDEV_MS",
                     "DETECT_MAX_SILENCE_MS", "DETECT_REFUSED_SILENCE_MS", "DETECT_FRESHNESS_MS",
                     "DETECT_GOSSIP_FANOUT"], lambda: _C.detect.CoreOptions.from_env(0, 1)),
    **dict.fromkeys(["DETECT_HANG_SAFETY_FACTOR", "DETECT_HANG_MIN_STEP_S", "DETECT_HANG_STEP_S",
                     "DETECT_HANG_STARTUP_S", "DETECT_HANG_CHECKPOINT_S"],
                    lambda: _C.detect.WatchdogOptions.from_env()),
}


# The native check also compares with another setting (at its default here).
_CROSS = {"STRAGGLER_SLOW_RATIO", "STRAGGLER_CUSUM_CLIP", "STRAGGLER_CUSUM_CAP"}


# Python refuses more than the native check: a value the component would take but that means
# nothing useful (a negative pause, no deviation, a limit of 0 that reports every step a hang).
_STRICTER = {"DETECT_ACCEPTABLE_PAUSE_MS", "DETECT_MIN_STDDEV_MS", "DETECT_HANG_STARTUP_S",
             "DETECT_HANG_CHECKPOINT_S"}


@pytest.mark.parametrize("short", sorted(_NATIVE))
def test_python_and_the_native_reader_agree_at_the_range_edges(short, monkeypatch):
    """At each edge of the table's range the native options reader agrees with settings.get,
    and where it refuses, its message names the variable."""
    name = "RESILIENT_" + short
    for text, inside in _edges(settings.SETTINGS[name]):
        monkeypatch.setenv(name, text)
        try:
            _NATIVE[short]()
            native = None
        except ValueError as e:
            native = str(e)
        if native is not None:
            assert name in native, (text, native)
        if short in _CROSS and inside:
            continue
        if short in _STRICTER and not inside:
            continue
        assert (native is None) == inside, (text, native)


_WORDS = st.text(alphabet="0123456789.-+eEkKmMgGiIbBxnoftrueyasl ", max_size=8)


@hsettings(max_examples=300, deadline=None)
@given(_WORDS)
def test_python_and_cpp_accept_the_same_spellings(text):
    """The same text through settings.get and through a C++ options struct's from_env: both
    accept it with the same value, or both refuse it."""
    cases = [("RESILIENT_STRAGGLER_INTERVAL", "interval"),
             ("RESILIENT_STRAGGLER_Z_THRESHOLD", "z_threshold")]
    for name, attr in cases:
        old = os.environ.get(name)
        os.environ[name] = text
        try:
            try:
                py = ("ok", settings.get(name))
            except ValueError:
                py = ("error", None)
            try:
                options = _C.straggler.StragglerOptions.from_env()
                options.validate()
                native = ("ok", getattr(options, attr))
            except ValueError:
                native = ("error", None)
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        if not text.strip():  # unset: both take the default
            continue
        assert py[0] == native[0], (name, text, py, native)
        if py[0] == "ok":
            assert py[1] == pytest.approx(native[1]), (name, text)
