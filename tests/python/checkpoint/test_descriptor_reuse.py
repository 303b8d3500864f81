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


def _change_dtensor(d, how: str, value: float):
    """A DTensor `d` (Shard(0) over a 1-rank CPU mesh) after one change between saves; the
    result has d's name, global shape and dtype. Reuse of the last save's local chunk (the
    checkpointer's _local_held) must notice every change that matters."""
    from torch.distributed.tensor import distribute_tensor

    if how == "in_place":
        with torch.no_grad():
            d._local_tensor.add_(value)
    elif how == "replaced":  # a new DTensor object
        d = distribute_tensor(torch.full((N, N), value), d.device_mesh, d.placements)
    elif how == "local_replaced":  # the same DTensor, another local tensor object
        d._local_tensor = torch.full((N, N), value)
    elif how == "data_assigned":  # the same local tensor object, another storage
        d._local_tensor.data = torch.full((N, N), value)
    elif how == "local_transposed":  # the same DTensor, a non-contiguous local tensor
        d._local_tensor = d._local_tensor.t()
    elif how == "requires_grad":
        t = d._local_tensor
        if not t.is_leaf:  # an earlier round's view (local_transposed) of a tensor with grad:
            t = d._local_tensor = t.detach()  # only a leaf's flag can change
        t.requires_grad_(not t.requires_grad)
    return d


D_HOW = st.sampled_from(["unchanged", "in_place", "replaced", "local_replaced", "data_assigned",
                         "local_transposed", "requires_grad"])


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=st.lists(st.tuples(D_HOW, D_HOW, st.floats(-4, 4, allow_nan=False), st.booleans()),
                       min_size=1, max_size=4))
def test_every_save_of_dtensors_holds_their_values_at_the_save(tmp_path_factory, rounds):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = tmp_path_factory.mktemp("ck")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        state = {k: distribute_tensor(torch.randn(N, N, generator=g), mesh, [Shard(0)])
                 for k in ("a", "b")}

        def values():
            return {k: v._local_tensor.detach().clone() for k, v in state.items()}

        with resilient.Checkpointer(root, keep=0) as ck:
            ck.save(0, state).wait()
            expected = {0: values()}
            for step, (how_a, how_b, value, overlap) in enumerate(rounds, start=1):
                state["a"] = _change_dtensor(state["a"], how_a, value)
                state["b"] = _change_dtensor(state["b"], how_b, value)
                h = ck.save(step, state, mode="overlap" if overlap else "blocking")
                expected[step] = values()
                h.wait()
            for step, want in expected.items():
                out = {k: torch.zeros(N, N) for k in want}
                assert ck.load(out, step=step) == step
                for k in want:
                    assert torch.equal(out[k], want[k]), (step, k, rounds)
    finally:
        dist.destroy_process_group()


def test_the_reuse_keeps_no_saved_dtensor_alive(tmp_path):
    """The last save's DTensors are held weakly: dropping the model frees them."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.randn(N, N), mesh, [Shard(0)])
        gone, local_gone = weakref.ref(d), weakref.ref(d._local_tensor)
        with resilient.Checkpointer(tmp_path / "ck", keep=0) as ck:
            ck.save(0, {"w": d}).wait()
            ck.save(1, {"w": d}).wait()  # the second save reuses the first's chunk
            del d
            gc.collect()
            assert gone() is None and local_gone() is None
    finally:
        dist.destroy_process_group()


def test_a_save_that_failed_while_describing_leaves_no_stale_descriptor(tmp_path, monkeypatch):
    """The native copy of the descriptors (_C.TensorSpecs) is reused only when every descriptor
    was: a save that raised after updating some descriptors must not leave the next save, which
    finds them all current, writing from the old pointers."""
    from resilient.checkpoint import checkpointer as cmod

    state = _initial()
    original = state["real"]
    with resilient.Checkpointer(tmp_path / "ck", keep=0) as ck:
        ck.save(0, state).wait()
        # The plan's order is cplx, other, real: "other" is described anew, then "real" fails.
        state["other"] = torch.arange(N * N, dtype=torch.int64) * 3
        state["real"] = torch.full((N, N), 7.0)
        real = cmod.tensor_descriptor
        calls = []

        def fail_second(name, t, keep, streams=None):
            calls.append(name)
            if len(calls) == 2:
                raise RuntimeError("injected")
            return real(name, t, keep, streams)

        monkeypatch.setattr(cmod, "tensor_descriptor", fail_second)
        try:
            ck.save(1, state).wait()
        except RuntimeError as e:
            assert "injected" in str(e)
        monkeypatch.setattr(cmod, "tensor_descriptor", real)
        assert len(calls) == 2  # "other" was described anew before the failure
        state["real"] = original  # every descriptor is now the last one made
        ck.save(2, state).wait()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.load(out, step=2) == 2
        for k in state:
            assert torch.equal(out[k], state[k]), k


def test_prepared_descriptors_need_a_stream_for_each_cuda_device(tmp_path):
    """_C.TensorSpecs: a CUDA descriptor whose device has no stream in this save is refused
    before anything is read (the pointer here is never dereferenced)."""
    from resilient import _C

    native = _C.Checkpointer(_C.CheckpointOptions(str(tmp_path / "ck")))
    specs = _C.TensorSpecs([{"name": "w", "dtype": "float32", "shape": (2,), "ptr": 4096,
                             "nbytes": 8, "device": 0}])
    assert len(specs) == 1
    try:
        native.save_specs(0, specs, {}, [], "{}", False, "overlap")
    except ValueError as e:
        assert "no stream given for CUDA device 0" in str(e)
    else:
        raise AssertionError("a CUDA descriptor without a stream was accepted")


def test_a_save_pauses_garbage_collection_only_while_it_walks(tmp_path):
    """Collection is off while the state is walked (a Stateful sees it off), on again when
    save() returns or raises, and left off when the caller had turned it off."""
    import gc

    seen = []

    class Probe:
        def state_dict(self):
            seen.append(gc.isenabled())
            return {"t": torch.ones(2)}

        def load_state_dict(self, sd):
            pass

    assert gc.isenabled()
    with resilient.Checkpointer(tmp_path / "ck", keep=0) as ck:
        ck.save(0, {"p": Probe()}).wait()
        assert seen == [False] and gc.isenabled()
        try:
            ck.save(1, {"p": Probe(), "bad": object()})
        except TypeError:
            pass
        else:
            raise AssertionError("an object() was saved")
        assert gc.isenabled()
        gc.disable()
        try:
            ck.save(2, {"p": Probe()}).wait()
            assert not gc.isenabled()
        finally:
            gc.enable()
