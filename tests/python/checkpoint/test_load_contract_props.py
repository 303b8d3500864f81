"""Property-based tests of the load contract (hypothesis): generated nested states saved and
loaded through every idiom (objects or their state dicts on either side), then mutated targets
(renamed, added or removed keys, dtype, shape, length and kind changes). Every target tensor is
restored bit-exact, or the load raises IncompatibleCheckpointError and the target is unchanged.

CI runs a bounded number of examples; RESILIENT_PROPERTY_EXAMPLES raises it (the longer run is
recorded in benchmarks/RESULTS.md)."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient
from resilient import IncompatibleCheckpointError

EXAMPLES = int(os.environ.get("RESILIENT_PROPERTY_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


class Box:
    """A Stateful object around a dict (a user's object with state_dict/load_state_dict)."""

    def __init__(self, d: dict):
        self.d = d

    def state_dict(self) -> dict:
        return self.d

    def load_state_dict(self, sd: dict) -> None:
        for k in list(self.d):
            self.d[k] = sd[k]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 16,), generator=g,
                        dtype=torch.uint8)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    t = raw[:n].view(dtype).reshape(shape).clone() if n else torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        t = t.view(torch.uint8).bitwise_and(1).view(torch.bool)
    return t


plain = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                  st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8))
keys = st.text("abcdefgh", min_size=1, max_size=3)


def states(depth: int = 3):
    leaf = st.one_of(tensors(), plain)
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.dictionaries(keys, inner, min_size=1, max_size=4),
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
        ),
        max_leaves=12,
    )


top = st.dictionaries(keys, states(), min_size=1, max_size=4)


def blank(x):
    """The same structure with every tensor zeroed (a fresh target) and plain values changed."""
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: blank(v) for k, v in x.items()}
    if isinstance(x, list):
        return [blank(v) for v in x]
    if isinstance(x, tuple):
        return tuple(blank(v) for v in x)
    return "changed" if x is not None else None


def same(a, b) -> bool:
    if isinstance(a, Box):
        a = a.d
    if isinstance(b, Box):
        b = b.d
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a.reshape(-1),
                                b.reshape(-1).view(torch.uint8) if b.numel() else b.reshape(-1)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return a == b and type(a) is type(b)


def wrap(state: dict, which: list[bool]) -> dict:
    """Top-level dict entries as Box objects where `which` says so (the object idiom)."""
    return {k: Box(v) if i < len(which) and which[i] and isinstance(v, dict) else v
            for i, (k, v) in enumerate(state.items())}


def snapshot(x):
    if isinstance(x, Box):
        return Box(snapshot(x.d))
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: snapshot(v) for k, v in x.items()}
    if isinstance(x, list):
        return [snapshot(v) for v in x]
    if isinstance(x, tuple):
        return tuple(snapshot(v) for v in x)
    return copy.copy(x)


@pytest.fixture(scope="module")
def ckpt():
    with tempfile.TemporaryDirectory() as d, resilient.Checkpointer(d, keep=1) as ck:
        ck.step = 0
        yield ck


def save(ck, state) -> int:
    ck.step += 1
    ck.save(ck.step, state).wait()
    return ck.step


@SETTINGS
@given(state=top, save_objects=st.lists(st.booleans(), min_size=4, max_size=4),
       load_objects=st.lists(st.booleans(), min_size=4, max_size=4))
def test_every_idiom_restores_every_tensor_bit_exact(ckpt, state, save_objects, load_objects):
    step = save(ckpt, wrap(state, save_objects))
    target = wrap(blank(state), load_objects)
    assert ckpt.load(target, step=step) == step
    assert same({k: (v.d if isinstance(v, Box) else v) for k, v in target.items()}, state)


def paths(x, prefix=()):
    """(path, value) of every node below the top level."""
    out = []
    if isinstance(x, dict):
        for k, v in x.items():
            out.append(((*prefix, k), v))
            out += paths(v, (*prefix, k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            out.append(((*prefix, i), v))
            out += paths(v, (*prefix, i))
    return out


def parent_of(root, path):
    node = root
    for p in path[:-1]:
        node = node[p]
    return node


MUTATIONS = ["rename", "add", "remove", "dtype", "shape", "kind", "length"]


def mutate(target: dict, kind: str, pick: int) -> bool:
    """Applies one mutation in place; False when the state has no place for it."""
    nodes = paths(target)
    if kind in ("rename", "add", "remove"):
        dicts = [((), target)] + [(p, v) for p, v in nodes if isinstance(v, dict)]
        dicts = [(p, d) for p, d in dicts if len(d) >= 2 or kind != "remove"]
        if not dicts:
            return False
        _, d = dicts[pick % len(dicts)]
        k = list(d)[pick % len(d)]
        if kind == "rename":
            d["zz" + k] = d.pop(k)
        elif kind == "add":
            d["zz" + k] = torch.zeros(1)
        else:
            del d[k]
        return True
    if kind in ("dtype", "shape", "kind"):
        ts = [p for p, v in nodes if isinstance(v, torch.Tensor)
              and isinstance(parent_of(target, p), (dict, list))]
        if not ts:
            return False
        path = ts[pick % len(ts)]
        parent, t = parent_of(target, path), None
        t = parent[path[-1]]
        if kind == "dtype":
            new = torch.zeros(t.shape, dtype=torch.float32 if t.dtype != torch.float32
                              else torch.float64)
        elif kind == "shape":
            new = torch.zeros((*t.shape, 2), dtype=t.dtype)
        else:
            new = 1.5
        parent[path[-1]] = new
        return True
    lists = [(p, v) for p, v in nodes if isinstance(v, list)]
    if not lists:
        return False
    _, lst = lists[pick % len(lists)]
    lst.append(torch.zeros(1))
    return True


@SETTINGS
@given(state=top, kind=st.sampled_from(MUTATIONS), pick=st.integers(0, 1000),
       load_objects=st.lists(st.booleans(), min_size=4, max_size=4))
def test_a_target_that_does_not_fit_raises_and_is_unchanged(ckpt, state, kind, pick,
                                                            load_objects):
    step = save(ckpt, state)
    target = blank(state)
    if not mutate(target, kind, pick):
        return
    target = wrap(target, load_objects)
    before = snapshot(target)
    with pytest.raises(IncompatibleCheckpointError):
        ckpt.load(target, step=step)
    assert same(before, target)
    # strict=False restores whatever still matches, and says what it skipped
    ckpt.load(target, step=step, strict=False)
    report = ckpt.last_load
    assert report.missing or report.unexpected or report.mismatched
