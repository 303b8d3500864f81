"""Checkpointer: round trips of every kind of state, and every bad-input path."""


from __future__ import annotations

import errno
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import resilient
from resilient import CorruptCheckpointError, VersionMismatchError

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def rand(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so that NaNs and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        state[name] = {
            "0d": rand((), dt, gen),
            "empty": rand((0, 3), dt, gen),
            "big": rand((257, 33), dt, gen),
        }
    base = torch.randn(8, 6, generator=gen)
    state["views"] = {"t": base.t(), "strided": base[::2, 1::2], "narrow": base[2:5]}
    expected = {k: {n: t.clone() for n, t in v.items()} for k, v in state.items()}
    with resilient.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state).wait()
        for group in state.values():  # change everything after save returned
            for t in group.values():
                if t.numel():
                    t.zero_() if t.dtype != torch.bool else t.logical_not_()
        assert ckpt.load(state) == 1
    for k, group in expected.items():
        for n, t in group.items():
            got = state[k][n]
            assert got.dtype == t.dtype and got.shape == t.shape, (k, n)
            assert torch.equal(bits(got), bits(t)), (k, n)
    # the non-contiguous views were restored in place into the same storage
    assert torch.equal(state["views"]["t"], base.t())


def test_plain_values_round_trip_with_their_types(tmp_path):
    values = {
        "int": 7,
        "neg": -3,
        "big": 2**80,
        "float": 0.1,
        "nan": math.nan,
        "inf": -math.inf,
        "str": "héllo",
        "none": None,
        "bool": True,
        "list": [1, [2, 3]],
        "tuple": (1, (2, "x")),
        "bytes": b"\x00\xff",
        "intkeys": {0: "a", 5: {"k": (1,)}},
        "dollar": {"$tensor": "not a tensor"},
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "npscalar": np.float32(1.5),
    }
    with resilient.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, values).wait()
        out: dict = {}
        assert ckpt.load(out) == 3
    assert (
        out["big"] == 2**80
        and out["float"] == 0.1
        and math.isnan(out["nan"])
        and out["inf"] == -math.inf
    )
    assert out["tuple"] == (1, (2, "x")) and isinstance(out["tuple"][1], tuple)
    assert out["list"] == [1, [2, 3]] and out["bytes"] == b"\x00\xff"
    assert out["intkeys"] == {0: "a", 5: {"k": (1,)}}
    assert out["dollar"] == {"$tensor": "not a tensor"}
    assert out["str"] == "héllo" and out["none"] is None and out["bool"] is True
    np.testing.assert_array_equal(out["np"], values["np"])
    assert out["npscalar"] == np.float32(1.5) and isinstance(out["npscalar"], np.float32)


def test_values_the_fast_json_encoder_refuses_still_save(tmp_path):
    """The values document goes through orjson, which refuses str-subclass keys, float
    subclasses and nesting past 255 levels; those states saved before it and must still save
    (with several ranks the encoder runs after the collectives, on rank 0 alone)."""
    import enum

    class Color(str, enum.Enum):
        RED = "red"

    class Meters(float):
        pass

    deep: object = torch.arange(3.0)
    for _ in range(253):  # within the codec's 256 levels, past orjson's 255 with the values'
        deep = [deep]
    values = {"enum_keys": {Color.RED: torch.ones(2)}, "meters": Meters(2.5), "deep": deep}
    with resilient.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, values).wait()
        out: dict = {}
        assert ckpt.load(out) == 1
    assert torch.equal(out["enum_keys"][Color.RED], torch.ones(2))
    assert out["meters"] == 2.5
    node = out["deep"]
    for _ in range(253):
        node = node[0]
    assert torch.equal(node, torch.arange(3.0))


def make_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps, gen):
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_stateful_objects_resume_exactly(tmp_path):
    model, opt, sched = make_training()
    gen = torch.Generator().manual_seed(1)
    train(model, opt, sched, 5, gen)
    with resilient.Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, {"model": model, "optim": opt, "sched": sched, "gen": gen.get_state()}).wait()
        reference = train(model, opt, sched, 4, gen)
        model2, opt2, sched2 = make_training(seed=123)  # fresh objects, empty optimizer state
        state = {"model": model2, "optim": opt2, "sched": sched2, "gen": None}
        assert ckpt.load(state) == 5
    gen2 = torch.Generator()
    gen2.set_state(state["gen"])
    assert train(model2, opt2, sched2, 4, gen2) == reference
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_no_checkpoint_returns_none_and_unknown_objects_are_refused(tmp_path):
    with resilient.Checkpointer(tmp_path, create=True) as ckpt:
        assert ckpt.load({}) is None
        with pytest.raises(TypeError, match="without pickle"):
            ckpt.save(1, {"obj": object()})
        with pytest.raises(FileNotFoundError):
            ckpt.load({}, step=9)


def test_dtype_and_shape_mismatch_name_the_tensor(tmp_path):
    with resilient.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.zeros(2, 3)}).wait()
        with pytest.raises(ValueError, match="'w'.*float32"):
            ckpt.load({"w": torch.zeros(3, 2)})
        with pytest.raises(ValueError, match="'w'"):
            ckpt.load({"w": torch.zeros(2, 3, dtype=torch.float16)})


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def _save_steps(root, steps=(1, 2)):
    with resilient.Checkpointer(root, keep=5) as ckpt:
        for s in steps:
            ckpt.save(s, {"w": torch.full((1000,), float(s)), "step": s}).wait()


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_shard", "manifest_garbage"])
def test_damaged_newest_falls_back_to_older(tmp_path, damage):
    _save_steps(tmp_path)
    d = _step_dir(tmp_path, 2)
    data = d / "rank-00000.data"
    if damage == "flip":
        b = bytearray(data.read_bytes())
        b[100] ^= 1
        data.write_bytes(bytes(b))
    elif damage == "truncate":
        os.truncate(data, 10)
    elif damage == "missing_shard":
        data.unlink()
    else:
        (d / "manifest.json").write_text('{"format": "resilient-checkpoint", "vers')
    with resilient.Checkpointer(tmp_path) as ckpt:
        state = {"w": torch.zeros(1000), "step": 0}
        assert ckpt.load(state) == 1
        assert state["step"] == 1 and torch.equal(state["w"], torch.full((1000,), 1.0))
        assert [s for s, _ in ckpt.last_load.skipped] == [2]
        exc = FileNotFoundError if damage == "missing_shard" else CorruptCheckpointError
        with pytest.raises(exc):
            ckpt.load(state, step=2)


def test_flipped_byte_error_names_file_and_offset(tmp_path):
    _save_steps(tmp_path, steps=(1,))
    data = _step_dir(tmp_path, 1) / "rank-00000.data"
    b = bytearray(data.read_bytes())
    b[200] ^= 0x80
    data.write_bytes(bytes(b))
    with resilient.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CorruptCheckpointError) as info:
            ckpt.load({}, step=1)
        assert info.value.path == str(data) and info.value.offset == 0
        with pytest.raises(CorruptCheckpointError, match="no checkpoint .* verifies"):
            ckpt.load({})
        with pytest.raises(CorruptCheckpointError):
            ckpt.verify(1)


def test_unknown_version_and_hostile_paths(tmp_path):
    _save_steps(tmp_path)
    manifest = _step_dir(tmp_path, 2) / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["version"] = 99
    manifest.write_text(json.dumps(doc))
    with resilient.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(VersionMismatchError, match="version 99"):
            ckpt.load({}, step=2)
        assert ckpt.load({}) == 1
    doc["version"] = 1
    doc["shards"][0]["file"] = "../../../etc/passwd"
    manifest.write_text(json.dumps(doc))
    with resilient.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="escapes"):
            ckpt.load({}, step=2)


def test_values_with_unknown_tags_are_rejected(tmp_path):
    _save_steps(tmp_path, steps=(1,))
    manifest = _step_dir(tmp_path, 1) / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["values"]["ranks"][0]["state"] = {"$pickle": "Y29zCnN5c3RlbQ=="}
    manifest.write_text(resilient._C.seal_manifest(json.dumps(doc)))
    with resilient.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="unknown tag"):
            ckpt.load({}, step=1)


def test_disk_full_fails_the_save_and_keeps_the_previous(small_tmpfs):
    with resilient.Checkpointer(small_tmpfs, keep=5) as ckpt:
        ckpt.save(1, {"w": torch.ones(1 << 20)}).wait()  # 4 MiB
        h = ckpt.save(2, {"w": torch.full((4 << 20,), 2.0)})  # 16 MiB: does not fit
        with pytest.raises(OSError) as info:
            h.wait(timeout=60)
        assert info.value.errno == errno.ENOSPC
        assert ckpt.steps() == [1]
        state = {"w": torch.zeros(1 << 20)}
        assert ckpt.load(state) == 1 and torch.equal(state["w"], torch.ones(1 << 20))
        ckpt.save(3, {"w": torch.full((1 << 20,), 3.0)}).wait()  # space was given back
        assert ckpt.steps() == [1, 3]


def test_retention_keeps_newest(tmp_path):
    with resilient.Checkpointer(tmp_path, keep=2) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, {"w": torch.full((10,), float(s))})
        ckpt.wait()
        assert ckpt.steps() == [4, 5]


def test_compressed_checkpoints_round_trip(tmp_path):
    state = {"w": torch.zeros(1 << 18), "r": torch.randn(1000)}
    with resilient.Checkpointer(tmp_path, zstd_level=3) as ckpt:
        h = ckpt.save(1, state)
        h.wait()
        assert h.stats()["stored_bytes"] < h.stats()["bytes"] / 4
        out = {"w": torch.ones(1 << 18), "r": torch.zeros(1000)}
        ckpt.load(out)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["r"], state["r"])


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes"):
        resilient.Checkpointer(tmp_path, chunk_bytes=1000)
    with pytest.raises(TypeError, match="unknown checkpoint option"):
        resilient.Checkpointer(tmp_path, colour="blue")
    with pytest.raises(ValueError, match="auto, on or off"):
        resilient.Checkpointer(tmp_path, io_uring="sometimes")


def test_a_fifo_or_a_symlink_in_place_of_a_shard_is_refused_not_followed(tmp_path):
    _save_steps(tmp_path)
    data = _step_dir(tmp_path, 2) / "rank-00000.data"
    outside = tmp_path.parent / f"{tmp_path.name}-outside.data"
    os.rename(data, outside)
    os.mkfifo(data)  # used to block open() forever
    with resilient.Checkpointer(tmp_path) as ckpt:
        state = {"w": torch.zeros(1000), "step": 0}
        t0 = time.monotonic()
        assert ckpt.load(state) == 1 and state["step"] == 1
        assert time.monotonic() - t0 < 30
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            ckpt.load(state, step=2)
    data.unlink()
    os.symlink(outside, data)  # the right bytes, but outside the root: refused
    with resilient.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            ckpt.load({"w": torch.zeros(1000), "step": 0}, step=2)


def test_a_planted_symlink_in_a_save_directory_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    root = tmp_path / "root"
    _save_steps(root, steps=(1,))
    tmp = root / ".tmp-step-000000000002"
    tmp.mkdir()
    os.symlink(victim, tmp / "rank-00000.data")
    with resilient.Checkpointer(root, keep=5) as ckpt:
        h = ckpt.save(2, {"w": torch.full((1000,), 2.0), "step": 2})
        with pytest.raises(OSError):
            h.wait(60)
        assert ckpt.steps() == [1]
    assert victim.read_text() == "precious"


def test_a_pool_below_one_slab_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="pool_bytes .* less than one host buffer slab"):
        resilient.Checkpointer(tmp_path, pool_bytes=1 << 20)


def test_many_small_tensors_cost_their_payload_and_load_bit_exact(tmp_path):
    gen = torch.Generator().manual_seed(3)
    n = 50_000
    values = torch.randn(n, generator=gen)
    state = {f"t{i}": values[i : i + 1].clone() for i in range(n)}
    with resilient.Checkpointer(tmp_path, create=True) as ckpt:
        ckpt.save(1, state).wait()
        for t in state.values():
            t.zero_()
        assert ckpt.load(state) == 1
    payload = 4 * n
    data = _step_dir(tmp_path, 1) / "rank-00000.data"
    assert data.stat().st_size < 2 * payload + (64 << 10)  # was 4 KiB per tensor: 204.8 MB
    got = torch.cat([state[f"t{i}"] for i in range(n)])
    assert torch.equal(bits(got), bits(values))


def test_a_symlinked_step_directory_is_not_followed_and_load_falls_back(tmp_path):
    root = tmp_path / "root"
    _save_steps(root)
    step2 = _step_dir(root, 2)
    elsewhere = tmp_path / "elsewhere"
    os.rename(step2, elsewhere)  # the right bytes, outside the root
    os.symlink(elsewhere, step2)
    with resilient.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1]
        state = {"w": torch.zeros(1000), "step": 0}
        assert ckpt.load(state) == 1 and state["step"] == 1
    step2.unlink()
    os.symlink("/etc", step2)
    with resilient.Checkpointer(root) as ckpt:
        assert ckpt.load({"w": torch.zeros(1000), "step": 0}) == 1


def test_a_symlinked_save_directory_is_refused_and_nothing_written_outside(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "root"
    _save_steps(root, steps=(1,))
    os.symlink(victim, root / ".tmp-step-000000000002")
    with resilient.Checkpointer(root, keep=5) as ckpt:
        h = ckpt.save(2, {"w": torch.full((1000,), 2.0), "step": 2})
        with pytest.raises(OSError, match="symbolic link"):
            h.wait(60)
        assert ckpt.steps() == [1]
    assert list(victim.iterdir()) == []


def test_files_per_rank_writes_several_files_that_load_and_verify(tmp_path):
    """files_per_rank=4: one save is four data files (cut at large tensors), a load from a
    checkpointer with the default restores every tensor bit for bit, `resilient ckpt verify`
    checks every file, and a flipped byte in a further file is found and named."""
    from resilient.checkpoint.verify import verify_step

    gen = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(100_000 + 1_000 * i, generator=gen) for i in range(8)}
    state["tiny"] = torch.arange(3)
    with resilient.Checkpointer(tmp_path, files_per_rank=4) as ckpt:
        ckpt.save(1, state).wait()
    step_dir = tmp_path / "step-000000000001"
    data = sorted(p.name for p in step_dir.glob("*.data"))
    assert data == ["rank-00000.1.data", "rank-00000.2.data", "rank-00000.3.data",
                    "rank-00000.data"]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with resilient.Checkpointer(tmp_path) as reader:
        assert reader.load(target) == 1
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert verify_step(str(tmp_path), 1) == []
    victim = step_dir / "rank-00000.2.data"
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    problems = verify_step(str(tmp_path), 1)
    assert problems and "rank-00000.2.data" in str(problems[0]), problems
    with resilient.Checkpointer(tmp_path) as reader, pytest.raises(
            resilient.CorruptCheckpointError, match="rank-00000.2.data"):
        reader.load(target, step=1)


def test_a_closed_checkpointer_keeps_none_of_its_pool(tmp_path):
    """A checkpointer still referenced after close() (the variable after its `with` block, a
    failed test's traceback that hypothesis keeps) holds none of its host pool, which grows
    to a snapshot's size: before, each one kept its slabs until it was collected."""
    state = {"w": torch.randn(1 << 20)}
    with resilient.Checkpointer(tmp_path / "ck", create=True, distributed=False) as ck:
        ck.save(1, state).wait()
        ck.load(state)
        assert ck._native.pool_allocated_bytes > 0
    assert ck._native.pool_allocated_bytes == 0
