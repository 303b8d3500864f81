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
