"""`resilient ckpt export` / `import`: resilient -> safetensors / torch.save / DCP -> resilient is
bit-exact (tensors, non-tensor values and the state's structure), for any dtype and shape;
foreign files import as plain state."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.checkpoint import Checkpointer, catalog, convert, diff
from resilient.cli import main

pytest.importorskip("safetensors")

# dtypes every format stores (safetensors has no complex128 or 64-bit-only extras)
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
FORMATS = [("safetensors", "out"), ("torch", "out.pt"), ("dcp", "out")]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, subnormals included) of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    n = int(torch.tensor(shape).prod()) if shape else 1
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def assert_same_step(root_a: str, root_b: str, step_a: int | None = None) -> None:
    with catalog.StepReader(root_a, step_a) as a, catalog.StepReader(root_b) as b:
        assert a.step == b.step
        assert a.state_doc == b.state_doc
        assert a.rank_docs() == b.rank_docs()
        ta, tb = dict(a.iter_tensors()), dict(b.iter_tensors())
        assert ta.keys() == tb.keys()
        for name in ta:
            assert diff.same_bits(ta[name], tb[name]), name


def _save(root: str, step: int, state, rank_state=None) -> str:
    with Checkpointer(root, keep=0, create=True, distributed=False) as ck:
        ck.save(step, state, rank_state).wait()
    return root


@pytest.fixture()
def trained(tmp_path) -> str:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    opt = torch.optim.Adam(m.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    sched.step()
    import numpy as np

    state = {"model": m, "optim": opt, "sched": sched, "step": 5, "loss": float("nan"),
             "blob": b"\x00\x01", "np": np.arange(4, dtype=np.int16), "pair": (1, "a"),
             "ids": {3: "x", 1: "y"}, "big": 2**70}
    return _save(str(tmp_path / "src"), 5, state, {"rng": torch.get_rng_state(), "pos": 17})


@pytest.mark.parametrize("fmt,out", FORMATS)
def test_round_trip_is_exact(trained, tmp_path, capsys, fmt, out):
    dst = str(tmp_path / out)
    assert main(["ckpt", "export", trained, dst, "--format", fmt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 5 and summary["tensors"] > 10
    assert main(["ckpt", "import", dst, str(tmp_path / "back"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact"] and summary["format"] == fmt and summary["step"] == 5
    assert_same_step(trained, str(tmp_path / "back"))
    assert main(["ckpt", "diff", trained, str(tmp_path / "back")]) == 0
    # and the imported checkpoint restores the live objects
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    opt = torch.optim.Adam(m.parameters())
    with Checkpointer(str(tmp_path / "back"), distributed=False) as ck:
        state = {"model": m, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 3),
                 "step": 0, "loss": 0.0, "blob": b"", "np": None, "pair": None, "ids": {},
                 "big": 0}
        assert ck.load(state, strict=False) == 5
    assert state["step"] == 5 and state["big"] == 2**70
    assert opt.state_dict()["state"][0]["step"] == 1


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trip_any_dtype_and_shape(tmp_path_factory, data):
    fmt, out = data.draw(st.sampled_from(FORMATS))
    tensors = {}
    for i in range(data.draw(st.integers(1, 4))):
        dtype = data.draw(st.sampled_from(DTYPES))
        shape = tuple(data.draw(st.lists(st.integers(0, 5), max_size=3)))
        tensors[f"t{i}"] = _random(dtype, shape, i)
    base = tmp_path_factory.mktemp("prop")
    src = _save(str(base / "src"), 3, {"model": tensors, "n": len(tensors)})
    convert.export_checkpoint(src, str(base / out), fmt)
    convert.import_checkpoint(str(base / out), str(base / "back"))
    assert_same_step(src, str(base / "back"))


def test_key_export_is_a_plain_state_dict(trained, tmp_path, capsys):
    dst = str(tmp_path / "m.pt")
    assert main(["ckpt", "export", trained, dst, "--format", "torch", "--key", "model"]) == 0
    sd = torch.load(dst, weights_only=True)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    m.load_state_dict(sd)  # strict
    st_dir = str(tmp_path / "st")
    assert main(["ckpt", "export", trained, st_dir, "--format", "safetensors", "--key",
                 "model"]) == 0
    from safetensors.torch import load_file

    flat = load_file(os.path.join(st_dir, "model.safetensors"))
    assert flat.keys() == sd.keys() and all(torch.equal(flat[k], sd[k]) for k in sd)
    capsys.readouterr()
    assert main(["ckpt", "export", trained, str(tmp_path / "x"), "--format", "torch",
                 "--key", "nope"]) == 2
    assert "no state entry 'nope'" in capsys.readouterr().err


def test_sharded_safetensors_with_index(trained, tmp_path):
    dst = str(tmp_path / "st")
    s = convert.export_checkpoint(trained, dst, "safetensors", max_shard_size="100B")
    assert len(s["files"]) > 2 and "model.safetensors.index.json" in s["files"]
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(s["files"][:-1])
    assert index["metadata"]["total_size"] == s["bytes"]
    convert.import_checkpoint(dst, str(tmp_path / "back"))
    assert_same_step(trained, str(tmp_path / "back"))


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_import_foreign_checkpoint_under_a_key(tmp_path, fmt):
    torch.manual_seed(2)
    m = torch.nn.Linear(3, 2)
    sd = m.state_dict()
    if fmt == "torch":
        src = str(tmp_path / "w.pt")
        torch.save(sd, src)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        src = str(tmp_path / "w.safetensors")
        save_file(dict(sd), src)
    else:
        import torch.distributed.checkpoint as dcp

        src = str(tmp_path / "dcp")
        dcp.save(dict(sd), checkpoint_id=src, no_dist=True)
    assert main(["ckpt", "import", src, str(tmp_path / "root"), "--key", "model",
                 "--step", "7"]) == 0
    fresh = torch.nn.Linear(3, 2)
    with Checkpointer(str(tmp_path / "root"), distributed=False) as ck:
        assert ck.load({"model": fresh}) == 7
    assert torch.equal(fresh.weight, m.weight) and torch.equal(fresh.bias, m.bias)


def test_import_refuses_what_it_cannot_read(tmp_path, trained, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["ckpt", "import", str(bad), str(tmp_path / "r")]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["ckpt", "import", trained, str(tmp_path / "r")]) == 2
    assert "already a resilient checkpoint root" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r")
    dst = str(tmp_path / "o.pt")
    convert.export_checkpoint(trained, dst, "torch")
    convert.import_checkpoint(dst, str(tmp_path / "r"))
    assert main(["ckpt", "import", dst, str(tmp_path / "r")]) == 2  # step 5 exists
    assert "already holds committed steps [5]" in capsys.readouterr().err
