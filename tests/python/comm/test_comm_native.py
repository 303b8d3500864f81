"""resilient._C.comm through Python: settings, errors, stores and the real NCCL when present."""

from __future__ import annotations

import pytest

from resilient import UnavailableError
from resilient.comm import CommManager, CommOptions, InMemoryStore, load_nccl
from resilient.comm.native import NcclLibrary, torch_nccl_dir
from resilient.store import as_store


def _nccl():
    try:
        return load_nccl()
    except UnavailableError as exc:
        pytest.skip(f"no NCCL here: {exc}")


def test_options_defaults_setters_and_validation() -> None:
    o = CommOptions()
    assert o.init_timeout_s == 120 and o.rebuild_mode == "auto" and o.revoke == "auto"
    o.collective_timeout_s = 1.5
    o.rebuild_mode = "reinit"
    o.revoke = "off"
    assert (o.collective_timeout_s, o.rebuild_mode, o.revoke) == (1.5, "reinit", "off")
    with pytest.raises(ValueError):
        o.rebuild_mode = "sometimes"
    with pytest.raises(ValueError):
        o.init_timeout_s = -1


def test_options_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_COMM_STORE_TIMEOUT_S", "7")
    monkeypatch.setenv("RESILIENT_COMM_REBUILD", "shrink")
    o = CommOptions.from_env()
    assert (o.store_timeout_s, o.rebuild_mode) == (7, "shrink")


def test_missing_library_raises_unavailable() -> None:
    with pytest.raises(UnavailableError, match="RESILIENT_NCCL_PATH"):
        NcclLibrary.load("/nonexistent/lib", False)
    with pytest.raises(UnavailableError, match="disabled"):
        NcclLibrary.load("", True, "off")


def test_options_from_env_rejects_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_COMM_QUIESCE_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="RESILIENT_COMM_QUIESCE_TIMEOUT_S"):
        CommOptions.from_env()
    monkeypatch.setenv("RESILIENT_COMM_QUIESCE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="RESILIENT_COMM_QUIESCE_TIMEOUT_S='soon'"):
        CommOptions.from_env()


def test_in_memory_store_times_out() -> None:
    s = InMemoryStore()
    with pytest.raises(TimeoutError):
        s.get("k", 0.01)
    with pytest.raises(KeyError):
        s.get("k", 1.0, wait=False)
    s.set("k", b"\x00v")
    assert s.get("k", 0.01) == b"\x00v"
    assert s.compare_set("k", b"\x00v", b"w") == b"w"
    assert len(s) == 1


def test_real_nccl_loads_and_gates_features() -> None:
    lib = _nccl()
    assert lib.version >= 21400
    if torch_nccl_dir():
        assert torch_nccl_dir() in lib.origin
    if lib.version >= 22807:
        assert lib.supports("revoke") and lib.supports("shrink")
    m = CommManager(lib, CommOptions())
    assert len(m.new_unique_id()) == 128
    assert m.state == "empty"
    assert m.plan() == ("none", "reinit")  # nothing to tear down before the first init


class DictStore:
    """A Python store with torch.distributed.Store's methods; wait() never sees a key appear."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list) -> bool:
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        if self.data.get(key, b"") == expected:
            self.data[key] = desired
        return self.data.get(key, expected)

    def wait(self, keys: list, timeout: object = None) -> None:
        if not self.check(keys):
            raise TimeoutError(keys)


def test_python_store_timeout_reaches_init_from_store() -> None:
    """A store implemented in Python: its TimeoutError becomes the manager's Timeout."""
    lib = _nccl()
    o = CommOptions()
    o.store_timeout_s = 0.05
    m = CommManager(lib, o)
    with pytest.raises(TimeoutError, match="gen3/nccl_id"):
        m.init_from_store(DictStore(), 3, 2, 1)


def test_options_are_validated_before_use() -> None:
    lib = _nccl()
    o = CommOptions()
    o.name = ""
    with pytest.raises(ValueError, match="name"):
        o.validate()
    with pytest.raises(ValueError, match="name"):
        CommManager(lib, o)


def test_torch_store_through_the_native_adapter() -> None:
    dist = pytest.importorskip("torch.distributed")
    s = as_store(dist.HashStore())
    s.set("a", b"\x01\x02")
    assert s.get("a", 1.0) == b"\x01\x02"
    with pytest.raises(TimeoutError):
        s.get("missing", 0.05)
    with pytest.raises(KeyError):
        s.get("missing", 1.0, wait=False)
    assert s.compare_set("c", b"", b"first") == b"first"
    assert s.compare_set("c", b"", b"second") == b"first"
    with pytest.raises(KeyError):  # an absent key with an expected value is left absent
        s.compare_set("d", b"x", b"y")


def test_native_store_passes_through_the_adapter() -> None:
    s = InMemoryStore()
    assert as_store(s) is s
    no_wait = type("NoWait", (), {"set": 1, "get": 1, "compare_set": 1, "check": 1})
    with pytest.raises(TypeError, match="wait"):
        as_store(no_wait())
