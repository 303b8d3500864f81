"""resilient.settings: one table, parsed like the C++ core parses it, documented from itself."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from resilient import _C, settings
from resilient.recovery import RecoveryConfig

REPO = Path(__file__).resolve().parents[2]
# Variables that pass values between resilient's own processes (chaos runner -> job); not
# settings a user sets.
INTERNAL = {"RESILIENT_CHAOS_ATTEMPT", "RESILIENT_CHAOS_CKPT_DIR", "RESILIENT_CHAOS_STORE",
            # resilient run -> its workers
            "RESILIENT_LAUNCHER", "RESILIENT_JOIN", "RESILIENT_JOIN_FOR_RANK",
            "RESILIENT_JOIN_WORLD", "RESILIENT_JOIN_STORE",
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


_WORDS = st.text(alphabet="0123456789.-+eEkKmMgGiIbBxnoftrueyasl ", max_size=8)


@hsettings(max_examples=300, deadline=None)
@given(_WORDS)
def test_python_and_cpp_accept_the_same_spellings(text):
    """The same text through settings.get and through a C++ options struct's from_env: both
    accept it with the same value, or both refuse it."""
    cases = [("RESILIENT_STRAGGLER_INTERVAL", "interval"),
             ("RESILIENT_STRAGGLER_SLOW_RATIO", "slow_ratio")]
    for name, attr in cases:
        old = os.environ.get(name)
        os.environ[name] = text
        try:
            try:
                py = ("ok", settings.get(name))
            except ValueError:
                py = ("error", None)
            try:
                native = ("ok", getattr(_C.straggler.StragglerOptions.from_env(), attr))
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
