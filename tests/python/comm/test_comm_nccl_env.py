"""NCCL_RAS_ENABLE=0 is set before resilient creates NCCL communicators, unless the user set it."""

from __future__ import annotations

import os

import pytest

from resilient.comm import nccl_env
from resilient.errors import UnavailableError


def test_sets_ras_off_when_unset(monkeypatch):
    monkeypatch.delenv("NCCL_RAS_ENABLE", raising=False)
    assert nccl_env.prepare_nccl_env() is True
    assert os.environ["NCCL_RAS_ENABLE"] == "0"


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_keeps_what_the_user_chose(monkeypatch, value):
    monkeypatch.setenv("NCCL_RAS_ENABLE", value)
    assert nccl_env.prepare_nccl_env() is False
    assert os.environ["NCCL_RAS_ENABLE"] == value


def test_load_nccl_prepares_the_environment(monkeypatch):
    from resilient.comm import load_nccl

    monkeypatch.delenv("NCCL_RAS_ENABLE", raising=False)
    monkeypatch.setenv("RESILIENT_NCCL", "off")  # loading fails; the variable is set before
    with pytest.raises(UnavailableError):
        load_nccl()
    assert os.environ["NCCL_RAS_ENABLE"] == "0"


class _Stop(Exception):
    pass


def test_nccl_group_creation_prepares_the_environment_first(monkeypatch):
    torch = pytest.importorskip("torch")
    from resilient.comm import process_group as pg

    seen = []

    def fake_init(*args, **kwargs):  # records what NCCL would read at its first communicator
        seen.append(os.environ.get("NCCL_RAS_ENABLE"))
        raise _Stop

    monkeypatch.delenv("NCCL_RAS_ENABLE", raising=False)
    monkeypatch.setattr(pg.dist, "init_process_group", fake_init)
    with pytest.raises(_Stop):
        pg.join_process_group(torch.distributed.HashStore(), generation=1, rank=0, world_size=1,
                              backend="nccl")
    assert seen == ["0"]
