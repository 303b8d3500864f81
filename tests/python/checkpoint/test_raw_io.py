"""The raw I/O helpers behind `resilient bench`'s `raw` row (resilient._C.raw_write/raw_read)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient import _C


@pytest.mark.parametrize("uring", ["auto", "off"])
def test_raw_write_then_read_round_trip(tmp_path: Path, uring: str) -> None:
    path = tmp_path / "raw.bin"
    nbytes = 3 * (1 << 20) + 123  # unaligned: padded for O_DIRECT, then truncated
    w = _C.raw_write(str(path), nbytes, request_bytes=1 << 20, queue_depth=4, uring=uring)
    assert w["bytes"] == nbytes
    assert os.path.getsize(path) == nbytes
    assert w["seconds"] > 0
    assert w["engine"] in ("io_uring", "threads")
    if uring == "off":
        assert w["engine"] == "threads"
        assert w["registered"] is False
    r = _C.raw_read(str(path), request_bytes=1 << 20, queue_depth=4, uring=uring)
    assert r["bytes"] == nbytes
    assert r["engine"] == w["engine"]


def test_drop_file_cache(tmp_path: Path) -> None:
    path = tmp_path / "cached.bin"
    path.write_bytes(b"x" * (1 << 20))
    assert _C.drop_file_cache(str(path)) is True
    assert _C.drop_file_cache(str(tmp_path / "missing")) is False


def test_raw_errors_map_to_python_exceptions(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _C.raw_read(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="multiple of 4096"):
        _C.raw_write(str(tmp_path / "x"), 10, request_bytes=1000)
    with pytest.raises(ValueError):
        _C.raw_write(str(tmp_path / "x"), 10, uring="sometimes")
