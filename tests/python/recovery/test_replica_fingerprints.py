"""The replica check's fingerprints (checkpointer._fingerprints): small host tensors take a
pure-Python path that must give exactly the torch path's values, for any dtype, size, value and
layout; a mismatch would make equal replicas look different (or different ones equal)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint import checkpointer as ck

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def _torch_path(t: torch.Tensor) -> tuple[int, int]:
    b = t.detach().resolve_conj().resolve_neg().contiguous()  # what the engine writes
    if b.dim() and b.stride(-1) != 1:  # a size-1 dimension of another stride
        b = b.clone(memory_format=torch.contiguous_format)
    b = b.reshape(-1).view(torch.uint8)
    n8 = b.numel() // 8 * 8
    words = b[:n8].clone().view(torch.int64)
    tail = b[n8:].to(torch.int64)
    return tuple(int(x) for x in torch.stack([words.sum(), tail.sum() + 256 * b.numel()]))


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(DTYPES), raw=st.binary(min_size=0, max_size=256),
       transpose=st.booleans())
def test_small_host_fingerprints_equal_the_torch_path(dtype, raw, transpose):
    size = torch.empty(0, dtype=dtype).element_size()
    raw = raw[: len(raw) // size * size]
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else \
        torch.empty(0, dtype=dtype)
    if transpose and t.numel() % 2 == 0 and t.numel() > 0:
        t = t.reshape(2, -1).t()  # not contiguous
    assert ck._small_fingerprint(t) == _torch_path(t)
    assert ck._fingerprints({"a": t}, set()) == [_torch_path(t)]


def test_mixed_small_large_and_skipped_keep_their_order():
    small, large = torch.tensor(3.0), torch.arange(1000, dtype=torch.float32)
    got = ck._fingerprints({"s": small, "x": large, "l": large, "t": small}, {"x"})
    assert got == [_torch_path(small), None, _torch_path(large), _torch_path(small)]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 5), max_size=3),
       seed=st.integers(0, 2**16),
       view=st.sampled_from(["strided", "conj", "neg", "grad", "size1"]))
def test_views_fingerprint_the_values_written(dtype, shape, seed, view):
    """Conjugate and negative views, tensors that require grad, and size-1 dimensions of any
    stride (all once crashed the replica check) are fingerprinted as the bytes written: the
    resolved, dense values; both paths agree."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point or dtype.is_complex
         else torch.randint(0, 2 if dtype is torch.bool else 100, shape, generator=g).to(dtype))
    if view == "strided" and t.dim():
        t = t[::2]
    elif view == "size1" and t.dim():
        t = t[::2][:1]  # a size-1 dimension with stride 2
    elif view == "conj" and dtype.is_complex:
        t = t.conj()
    elif view == "neg" and dtype.is_complex:
        t = t.conj().imag  # a negative view
    elif view == "grad" and (dtype.is_floating_point or dtype.is_complex):
        t = t.clone().requires_grad_()
    written = t.detach().resolve_conj().resolve_neg().contiguous()
    assert ck._small_fingerprint(t) == _torch_path(written) == _torch_path(t)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "_SMALL_PRINT_BYTES", -1)  # the torch path
        assert ck._fingerprints({"t": t}, set()) == [_torch_path(written)]
