"""A save reuses a tensor's buffer descriptor from the previous save of the same plan while the
tensor is laid out as then. Property: whatever happens to the state's tensors between saves
(changed in place, replaced, replaced by a view sharing the pointer with another layout, shape
or dtype or a conjugate or negative bit, freed and reallocated), every save holds the values the
tensors had at the save, bit for bit."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient

N = 6  # elements per side of the square tensors


def _change(t: torch.Tensor, how: str, draw_value: float) -> torch.Tensor:
    """`t` after one change between saves; the result has t's name, shape and dtype."""
    if how == "in_place":
        return t.add_(draw_value if t.is_floating_point() or t.is_complex() else int(draw_value))
    if how == "replaced":
        return torch.full_like(t, draw_value).contiguous()
    if how == "freed_and_reallocated":  # the caller holds no other reference (the allocator
        shape, dtype = t.shape, t.dtype  # may or may not hand the address back)
        del t
        return torch.full(shape, draw_value, dtype=dtype)
    if how == "flattened_view":  # same pointer, another shape: a new plan
        return t.reshape(-1) if t.is_contiguous() else t
    if how == "dtype_view":  # same pointer, another dtype: a new plan
        if t.dtype in (torch.float32, torch.int32) and t.is_contiguous():
            return t.view(torch.int32 if t.dtype == torch.float32 else torch.float32)
        return t
    if how == "transposed_view":  # same pointer, same shape (square), not contiguous
        return t.t()
    if how == "conj_view":  # same pointer, the conjugate bit set
        return t.conj() if t.is_complex() else t
    if how == "neg_view":  # same pointer, the negative bit set
        return torch._neg_view(t) if t.is_complex() else t
    if how == "offset_view":  # another pointer into a larger buffer
        big = torch.full((2 * t.numel(),), draw_value, dtype=t.dtype)
        return big[t.numel() // 2: t.numel() // 2 + t.numel()].view(t.shape)
    return t  # unchanged


HOW = st.sampled_from(["unchanged", "in_place", "replaced", "freed_and_reallocated",
                       "transposed_view", "conj_view", "neg_view", "offset_view",
                       "flattened_view", "dtype_view"])


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    real = torch.randn(N, N, generator=g)
    cplx = torch.complex(torch.randn(N, N, generator=g), torch.randn(N, N, generator=g))
    return {"real": real, "cplx": cplx, "other": torch.arange(N * N, dtype=torch.int64)}


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=st.lists(st.tuples(HOW, HOW, st.floats(-4, 4, allow_nan=False), st.booleans()),
                       min_size=1, max_size=4))
def test_every_save_holds_the_values_at_the_save(tmp_path_factory, rounds):
    root = tmp_path_factory.mktemp("ck")
    state = _initial()
    with resilient.Checkpointer(root, keep=0) as ck:
        expected = {}
        ck.save(0, state).wait()
        expected[0] = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
        for step, (how_real, how_cplx, value, overlap) in enumerate(rounds, start=1):
            state["real"] = _change(state.pop("real"), how_real, value)
            state["cplx"] = _change(state.pop("cplx"), how_cplx, value)
            h = ck.save(step, state, mode="overlap" if overlap else "blocking")
            expected[step] = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
            h.wait()
        for step, want in expected.items():
            out = {k: torch.zeros_like(v) for k, v in want.items()}
            assert ck.load(out, step=step) == step
            for k in want:
                assert torch.equal(out[k], want[k]), (step, k, rounds)
