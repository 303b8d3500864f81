"""Replica fingerprints: the pure-Python path for small host tensors and the torch path agree
on every dtype and layout (ranks compare them, and a tensor's size decides which path it takes),
and they see the values that are written (conjugate and negative views resolved)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint import checkpointer as ck

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64]


def _torch_path(t: torch.Tensor, monkeypatch) -> tuple[int, int]:
    monkeypatch.setattr(ck, "_SMALL_PRINT_BYTES", -1)
    try:
        return ck._fingerprints({"t": t}, set())[0]
    finally:
        monkeypatch.undo()


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 5), max_size=3),
       seed=st.integers(0, 2**16), view=st.sampled_from(["plain", "transposed", "strided",
                                                           "conj", "neg", "grad"]))
def test_small_and_torch_paths_agree(dtype, shape, seed, view):
    with pytest.MonkeyPatch.context() as mp:
        g = torch.Generator().manual_seed(seed)
        t = (torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).to(dtype)
             if not dtype.is_floating_point and not dtype.is_complex
             else torch.randn(shape, generator=g).to(dtype))
        if view == "transposed" and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif view == "strided" and t.dim() >= 1:
            t = t[::2]
        elif view == "conj" and dtype.is_complex:
            t = t.conj()
        elif view == "neg" and dtype.is_complex:
            t = t.conj().imag  # a negative view
        elif view == "grad" and (dtype.is_floating_point or dtype.is_complex):
            t = t.clone().requires_grad_()
        small = ck._small_fingerprint(t)
        assert small == _torch_path(t, mp)
        resolved = t.detach().resolve_conj().resolve_neg().contiguous().clone()
        assert small == ck._small_fingerprint(resolved)  # the written values


def test_a_changed_value_changes_the_fingerprint():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    b[1] = 2.5
    assert ck._small_fingerprint(a) != ck._small_fingerprint(b)
    assert ck._small_fingerprint(torch.tensor(5.0)) != ck._small_fingerprint(torch.tensor(6.0))
