"""Write and read planning for sharded checkpoints (pure functions, no processes)."""

from __future__ import annotations

import itertools
import math

import pytest

from resilient.checkpoint.plan import (
    Held,
    Saved,
    ShardSpec,
    piece_name,
    plan_reads,
    plan_writes,
    split_piece_name,
)


def _held(name: str, shape: tuple[int, ...], spec: ShardSpec | None = None) -> Held:
    g, o = (spec.global_shape, spec.offset) if spec else (shape, tuple(0 for _ in shape))
    return Held(name, "float32", 4, shape, g, o)


def _replicated(world: int) -> list[list[Held]]:
    tensors = [_held(f"model/w{i}", (64 * (i + 1), 128)) for i in range(6)]
    tensors += [_held(f"model/b{i}", (7,)) for i in range(10)] + [_held("optim/step", ())]
    return [list(tensors) for _ in range(world)]


def _bytes(piece, held: dict[str, Held]) -> int:
    h = held[piece.name]
    if piece.rows is None:
        return math.prod(h.shape) * h.itemsize
    return (piece.rows[1] - piece.rows[0]) * math.prod(h.shape[1:]) * h.itemsize


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_replicated_state_is_written_once_and_evenly(world):
    everyone = _replicated(world)
    held = {h.name: h for h in everyone[0]}
    plans = [plan_writes(everyone, r, split_bytes=64 * 1024) for r in range(world)]
    # Every element of every tensor is written exactly once in total.
    for name, h in held.items():
        pieces = [p for plan in plans for p in plan if p.name == name]
        if any(p.rows is None for p in pieces):
            assert len(pieces) == 1
        else:
            spans = sorted(p.rows for p in pieces)
            assert spans[0][0] == 0 and spans[-1][1] == h.shape[0]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    loads = [sum(_bytes(p, held) for p in plan) for plan in plans]
    total = sum(loads)
    assert total == sum(math.prod(h.shape) * 4 for h in held.values())
    # Split tensors are shared equally; whole ones (< split_bytes each) balance the rest greedily.
    assert max(loads) - min(loads) <= 64 * 1024 + 128 * 4 * world, loads


def test_plan_is_deterministic_and_respects_holders():
    # Tensor-parallel pieces are held by their data-parallel replicas only (ranks 0,2 and 1,3).
    a = ShardSpec.split((256, 64), 0, 0, 2)
    b = ShardSpec.split((256, 64), 0, 1, 2)
    everyone = [
        [_held("fc1", (128, 64), a)],
        [_held("fc1", (128, 64), b)],
        [_held("fc1", (128, 64), a)],
        [_held("fc1", (128, 64), b)],
    ]
    plans = [plan_writes(everyone, r, split_bytes=1) for r in range(4)]
    assert plans == [plan_writes(everyone, r, split_bytes=1) for r in range(4)]
    assert plans[0][0].rows == (0, 64) and plans[2][0].rows == (64, 128)
    assert plans[1][0].rows == (0, 64) and plans[3][0].rows == (64, 128)


def test_piece_names_round_trip():
    for name, off in [("model/w", (0, 64)), ("a#2", (3,)), ("scalar", ()), ("x#@y", (1, 2, 3))]:
        assert split_piece_name(piece_name(name, off)) == (name, off)
    assert split_piece_name("model/w") is None


def _saved_split(gshape, dim, parts, tag="t"):
    out = []
    for i in range(parts):
        s = ShardSpec.split(gshape, dim, i, parts)
        out.append(Saved(piece_name(tag, s.offset), "float32", s.shape, s.global_shape, s.offset))
    return out


def test_reads_reshard_between_tensor_parallel_splits():
    saved = _saved_split((8, 6), 1, 2)  # saved with TP=2 along dim 1
    whole = plan_reads("t", "float32", (8, 6), None, saved)
    assert sorted(c.dst for c in whole) == [((0, 8), (0, 3)), ((0, 8), (3, 6))]
    quarter = ShardSpec.split((8, 6), 1, 1, 3)  # TP=3: columns 2..4 straddle both pieces
    copies = plan_reads("t", "float32", quarter.shape, quarter, saved)
    assert sorted((c.src, c.dst) for c in copies) == [
        (((0, 8), (0, 1)), ((0, 8), (1, 2))),
        (((0, 8), (2, 3)), ((0, 8), (0, 1))),
    ]


def test_unresolvable_mismatches_name_the_tensor():
    saved = _saved_split((8, 6), 0, 2, tag="model/fc1")
    with pytest.raises(ValueError, match=r"model/fc1.*global shape \[8, 6\]"):
        plan_reads("model/fc1", "float32", (8, 8), None, saved)
    with pytest.raises(ValueError, match=r"model/fc1.*bfloat16"):
        plan_reads("model/fc1", "bfloat16", (8, 6), None, saved)
    with pytest.raises(ValueError, match=r"model/fc1.*cover 24 of the 48"):
        plan_reads("model/fc1", "float32", (8, 6), None, saved[:1])
    with pytest.raises(ValueError, match="not in the checkpoint"):
        plan_reads("model/other", "float32", (8, 6), None, [])


def test_shard_spec_checks():
    with pytest.raises(ValueError, match="equal parts"):
        ShardSpec.split((10, 4), 0, 0, 3)
    s = ShardSpec.split((10, 4), 0, 1, 2)
    assert s.offset == (5, 0) and s.shape == (5, 4)
    with pytest.raises(ValueError, match="w.*differs from its shard spec"):
        s.check("w", (4, 4))
    s.check("w", (5, 4))


def test_overlapping_pieces_are_refused_even_when_the_volume_adds_up():
    from resilient.checkpoint.plan import Saved, plan_reads

    pieces = [Saved("a", "float32", (4,), (8,), (0,)), Saved("b", "float32", (4,), (8,), (2,))]
    with pytest.raises(ValueError, match="overlap"):
        plan_reads("t", "float32", (6,), ShardSpec((8,), (0,), (6,)), pieces)
