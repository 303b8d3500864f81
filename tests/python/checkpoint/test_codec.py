"""codec.encode/decode on random nested states: decoding the document gives back the state
(tuples and named tuples as tuples, tensors by name), tensor names are the '/'-joined key paths,
and plain sorted str-keyed dicts (str subclasses such as StrEnum included) stay JSON objects."""

from __future__ import annotations

import enum
import json
from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint import codec


class Color(enum.StrEnum):
    RED = "red"
    SLASH = "a/b"


KEYS = st.one_of(st.text(max_size=4), st.integers(-3, 3), st.sampled_from(list(Color)),
                 st.booleans(), st.none())
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=5),
                   st.floats(allow_nan=False), st.binary(max_size=4),
                   st.integers(0, 3).map(lambda n: torch.arange(n)))


def _states(leaves):
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(KEYS, inner, max_size=3),
        st.dictionaries(KEYS, inner, max_size=3).map(OrderedDict),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(lambda d: dict(sorted(
            d.items())))), max_leaves=12)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return b is a
    if isinstance(a, (list, tuple)):
        return (type(b) is type(a) or isinstance(a, tuple) and type(b) is tuple) and len(a) == len(
            b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (list(a) == list(b) and isinstance(b, OrderedDict) == isinstance(a, OrderedDict)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (bytes, bytearray)):
        return bytes(a) == b
    return type(a) is type(b) and a == b or (isinstance(a, str) and a == b)


def _paths(obj, path=()) -> list[str]:
    """The tensor names encode must give, found by a plain walk of the state."""
    if isinstance(obj, torch.Tensor):
        return ["/".join(path) or "tensor"]
    if isinstance(obj, (list, tuple)):
        return [n for i, v in enumerate(obj) for n in _paths(v, (*path, str(i)))]
    if isinstance(obj, dict):
        return [n for k, v in obj.items() for n in _paths(v, (*path, codec.key_str(k)))]
    return []


@settings(max_examples=300, deadline=None)
@given(state=_states(LEAVES))
def test_decode_of_encode_is_the_state_and_names_are_key_paths(state):
    enc = codec.encode(state)
    doc = json.loads(json.dumps(enc.doc, allow_nan=False))  # what the checkpoint stores
    back = codec.decode(doc, lambda kind, name: enc.tensors[name])
    assert _same(state, back), (state, back)
    expected = _paths(state)
    if len(set(expected)) == len(expected):  # duplicates get '#2' suffixes
        assert list(enc.tensors) == expected


def test_sorted_str_subclass_keys_stay_a_json_object():
    doc = codec.encode({Color.SLASH: torch.zeros(1), Color.RED: 1}).doc
    assert doc == {"a/b": {codec.TENSOR: "a%2Fb"}, "red": 1}
    assert list(codec.encode({"b": 1, "a": 2}).doc) == [codec.DICT]  # unsorted: pairs


_Point = __import__("collections").namedtuple("_Point", "x y")


class _Holder:
    """A Stateful object holding one value."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, sd):
        self.value = sd["v"]


_WRAP = {
    "list": lambda v: [v],
    "sorted_dict": lambda v: {"a": v},
    "unsorted_dict": lambda v: {"z": 0, "a": v},
    "int_keys": lambda v: {1: v},
    "odict": lambda v: OrderedDict([("a", v)]),
    "tuple": lambda v: (v,),
    "namedtuple": lambda v: _Point(v, 0),
    "stateful": _Holder,
}
_LEAVES = [torch.arange(2.0), 2**70, float("nan"), b"\x01", 3, "s", None,
           __import__("numpy").float32(1.5)]


@settings(max_examples=150, deadline=None)
@given(chain=st.lists(st.sampled_from(sorted(_WRAP)), min_size=60, max_size=300),
       leaf=st.sampled_from(range(len(_LEAVES))))
def test_whatever_encodes_loads_and_whatever_is_too_deep_fails_at_save(chain, leaf):
    """The encoder measures depth as the loader does: a state it accepts is one every loader
    walk accepts (no checkpoint that saves but cannot load), and a deeper one raises at save
    with a clear ValueError."""
    state = _LEAVES[leaf]
    for kind in chain:
        state = _WRAP[kind](state)
    try:
        enc = codec.encode(state)
    except ValueError as e:
        assert "nested too deeply" in str(e)
        return
    doc = json.loads(json.dumps(enc.doc))
    refs = codec.tensor_refs(doc)
    assert set(refs) == set(enc.tensors)
    codec.decode(doc, lambda kind, name: enc.tensors[name])
