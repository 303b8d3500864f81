"""codec.encode's C++ walk (_C.codec_walk) against its Python walk, on random states: the same
document, the same tensors under the same names in the same order, or the same error (type and
message). The states mix what the C++ walk takes (exact dicts, OrderedDicts, lists, plain
scalars, tensors and their subclasses) with what it must hand back (tuples, named tuples, str
subclasses, big ints, non-finite floats, bytes, numpy values, Stateful objects, dict
subclasses), keys that collide as paths, one tensor under several keys, and nesting around the
depth limit."""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint import codec


class Color(enum.StrEnum):
    RED = "red"
    SLASH = "a/b"


class Sub(dict):
    pass


class Box:
    """A Stateful object whose state is any nested value."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


Pair = namedtuple("Pair", "a b")
SHARED = torch.arange(3)

KEYS = st.one_of(st.text(max_size=3), st.sampled_from(["$x", "a/b", "é", "\ud800", "", "1", "k"]),
                 st.integers(-2, 2), st.sampled_from(list(Color)), st.booleans(), st.none(),
                 st.tuples(st.integers(0, 2)))
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**65, 2**65), st.text(max_size=4),
    st.sampled_from(["\udcff", "$tensor", "é"]),
    st.floats(), st.binary(max_size=3), st.just(SHARED),
    st.integers(0, 3).map(torch.zeros), st.integers(0, 2).map(lambda n: torch.nn.Parameter(
        torch.ones(n))),
    st.integers(0, 2).map(lambda n: np.arange(n)), st.just(np.float32(1.5)),
)


def _reordered(d: dict) -> OrderedDict:
    """An OrderedDict whose order is not its underlying dict's (move_to_end)."""
    od = OrderedDict(d)
    od.move_to_end(next(iter(od)))
    return od


def _states(leaves):
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.tuples(inner, inner).map(lambda t: Pair(*t)),
        st.dictionaries(KEYS, inner, max_size=3),
        st.dictionaries(KEYS, inner, max_size=3).map(OrderedDict),
        st.dictionaries(KEYS, inner, min_size=2, max_size=3).map(_reordered),
        st.dictionaries(KEYS, inner, max_size=2).map(Sub),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(lambda d: dict(sorted(
            d.items()))),
        inner.map(Box)), max_leaves=14)


def _outcome(state, native: bool):
    try:
        enc = codec.encode(state, native=native)
    except Exception as e:  # the same error either way
        return ("error", type(e), str(e))
    return ("ok", enc.doc, list(enc.tensors.items()))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _check(state) -> None:
    py, nat = _outcome(state, False), _outcome(state, True)
    assert py[0] == nat[0], (py, nat)
    if py[0] == "error":
        assert py[1:] == nat[1:]
        return
    assert _same(py[1], nat[1]), (py[1], nat[1])
    assert [n for n, _ in py[2]] == [n for n, _ in nat[2]]
    # numpy arrays become new tensors in each encode: compare their values
    for (_, a), (_, b) in zip(py[2], nat[2]):
        assert a is b or (a.dtype == b.dtype and torch.equal(a, b))


@settings(max_examples=400, deadline=None)
@given(state=_states(LEAVES))
def test_native_walk_gives_what_the_python_walk_gives(state):
    _check(state)


@settings(max_examples=60, deadline=None)
@given(levels=st.integers(codec.MAX_DEPTH - 6, codec.MAX_DEPTH + 2),
       kinds=st.lists(st.sampled_from(["list", "dict", "pairs", "odict", "tuple", "box"]),
                      min_size=1, max_size=4),
       leaf=st.sampled_from([SHARED, 1, "é", 2**70, float("inf"), b"x"]))
def test_the_depth_limit_is_the_same_in_both_walks(levels, kinds, leaf):
    state = leaf
    for i in range(levels):
        kind = kinds[i % len(kinds)]
        state = {"list": lambda s: [s], "dict": lambda s: {"k": s},
                 "pairs": lambda s: {"b": 1, "a/": s}, "odict": lambda s: OrderedDict(x=s),
                 "tuple": lambda s: (s,), "box": Box}[kind](state)
    _check(state)


def test_a_model_and_its_optimizer_encode_alike():
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    _check({"model": model, "optim": opt, "step": 3, "rng": torch.get_rng_state()})


class Mutator(Box):
    """A Stateful whose state_dict() changes the container it is walked in."""

    def __init__(self, change):
        super().__init__({})
        self.change = change

    def state_dict(self):
        self.change()
        return {}


def _dict_state(kind, how):
    d = kind()

    def change():
        if how == "grow":
            d["zz"] = 1
        elif how == "shrink":
            d.pop("a", None)
        else:  # another key at the same size
            d.pop("a", None)
            d["z"] = 9

    d.update(a=0, b=Mutator(change), c=1)
    return d


def _list_state(how):
    lst: list = [0]
    lst.append(Mutator(lambda: lst.append(5) if how == "grow" else lst.pop(0)))
    lst.append(torch.ones(1))
    return {"l": lst}


MUTATING = {f"{kind.__name__}-{how}": (lambda kind=kind, how=how: _dict_state(kind, how))
            for kind in (dict, OrderedDict) for how in ("grow", "shrink", "swap")}
MUTATING.update({f"list-{how}": (lambda how=how: _list_state(how)) for how in ("grow", "shrink")})


@pytest.mark.parametrize("name", sorted(MUTATING))
def test_a_state_changed_while_walked_gives_what_python_gives(name):
    """Containers that a Stateful inside them changes while they are walked (dicts and
    OrderedDicts grown, shrunk, a key swapped at one size; lists grown, shrunk): each walk sees
    it as Python's own iteration does. Each walk gets a fresh state."""
    make = MUTATING[name]
    py, nat = _outcome(make(), False), _outcome(make(), True)
    assert py[0] == nat[0], (name, py, nat)
    if py[0] == "error":
        assert py[1:] == nat[1:], name
    else:
        assert _same(py[1], nat[1]), (name, py[1], nat[1])
        assert [n for n, _ in py[2]] == [n for n, _ in nat[2]]


def test_an_ordered_dict_keeps_its_own_order():
    od = OrderedDict(a=torch.zeros(1), b=torch.ones(1))
    od.move_to_end("a")
    enc = codec.encode({"s": od})
    assert [k for k, _ in enc.doc["s"]["$odict"]] == ["b", "a"]
    assert list(enc.tensors) == ["s/b", "s/a"]
