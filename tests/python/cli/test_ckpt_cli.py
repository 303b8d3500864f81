"""`resilient ckpt`: ls, show, verify (a flipped byte in data, manifest or values), diff,
and clear errors for roots that are missing or not roots (exit 2, no traceback)."""


from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from damage import flip_byte
from resilient.checkpoint import Checkpointer, verify
from resilient.cli import main

STEP1 = "step-000000000001"


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return m, opt


def make_root(path: str, steps: tuple[int, ...] = (1, 2), seed: int = 0) -> str:
    m, opt = _model(seed)
    with Checkpointer(path, keep=0, create=True, distributed=False) as ck:
        for s in steps:
            ck.save(s, {"model": m, "optim": opt, "step": s, "note": "x"},
                    {"rng": torch.get_rng_state()}).wait()
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, _ = run_cli(capsys, *argv, "--json")
    return rc, json.loads(out)


def test_ls_lists_steps_lineage_and_sizes(root, capsys):
    rc, doc = run_json(capsys, "ckpt", "ls", root, "--verify")
    assert rc == 0
    assert doc["head"] == 2
    s1, s2 = doc["steps"]
    assert (s1["step"], s1["seq"], s1["parent"], s1["lineage"]) == (1, 1, None, "current")
    assert (s2["step"], s2["parent"]) == (2, 1)
    assert s2["world_size"] == 1 and s2["verified"] is True
    assert s2["bytes"] > 0 and s2["stored_bytes"] % 4096 == 0
    rc, out, _ = run_cli(capsys, "ckpt", "ls", root)
    assert rc == 0 and "current" in out and "STEP" in out


def test_show_outlines_state_and_tensors(root, capsys):
    rc, doc = run_json(capsys, "ckpt", "show", root, "--step", "1", "--tensors")
    assert rc == 0 and doc["step"] == 1
    assert doc["state"]["step"] == 1 and doc["state"]["note"] == "x"
    assert doc["state"]["model"].startswith("state_dict (4 tensors")
    names = {t["name"]: t for t in doc["tensors"]}
    assert names["model/0.weight"]["shape"] == [16, 8]
    assert "R0/rng" in names
    rc, out, _ = run_cli(capsys, "ckpt", "show", root, "--tensors")
    assert rc == 0 and "model/2.bias" in out and "step 2" in out


def _flip(path: str, offset: int) -> None:
    flip_byte(path, offset, 0x01)


def test_verify_clean_root_passes(root, capsys):
    rc, doc = run_json(capsys, "ckpt", "verify", root)
    assert rc == 0 and doc["ok"] and doc["steps"] == [1, 2]


def test_verify_finds_flipped_data_byte(root, capsys):
    data = os.path.join(root, STEP1, "rank-00000.data")
    _flip(data, 100)
    rc, doc = run_json(capsys, "ckpt", "verify", root)
    assert rc == 1 and not doc["ok"]
    (p,) = doc["problems"]
    assert p["step"] == 1 and p["file"] == data
    assert p["offset"] is not None and p["offset"] <= 100
    rc, out, _ = run_cli(capsys, "ckpt", "verify", root, "--step", "1")
    assert rc == 1 and f"{data} at offset {p['offset']}" in out
    assert run_cli(capsys, "ckpt", "verify", root, "--step", "2")[0] == 0


def _flip_in_manifest(root: str, needle: bytes, skip: int) -> tuple[str, int]:
    path = os.path.join(root, STEP1, "manifest.json")
    with open(path, "rb") as f:
        text = f.read()
    offset = text.index(needle) + skip
    _flip(path, offset)
    return path, offset


def test_verify_finds_flipped_manifest_byte(root, capsys):
    path, offset = _flip_in_manifest(root, b'"off":', 6)  # a chunk's offset
    rc, doc = run_json(capsys, "ckpt", "verify", root)
    assert rc == 1
    (p,) = doc["problems"]
    assert p["file"] == path and "checksum mismatch" in p["message"]
    assert p["offset"] is not None and abs(p["offset"] - offset) <= 20
    assert "tensors[" in p["message"]


def test_verify_finds_flipped_values_byte(root, capsys):
    path, offset = _flip_in_manifest(root, b'["note","x"]', 9)  # a value of the state
    rc, doc = run_json(capsys, "ckpt", "verify", root)
    assert rc == 1
    (p,) = doc["problems"]
    assert p["file"] == path and p["offset"] == offset - 1  # where the string starts
    assert "values.ranks[0].state.$dict[" in p["message"]


def test_verify_finds_damaged_lineage(root, capsys):
    _flip(os.path.join(root, STEP1, "lineage.json"), 3)
    rc, doc = run_json(capsys, "ckpt", "verify", root)
    assert rc == 1
    assert doc["problems"][0]["file"].endswith("lineage.json")


def test_verify_of_a_damaged_manifest_is_linear_in_its_tensors(tmp_path):
    """16384 tensors, a byte of the merged manifest flipped: the damage is located (file,
    offset, JSON path) in seconds; it took 166-268 s when each step rescanned the manifest."""
    root = str(tmp_path / "r")
    with Checkpointer(root, keep=0, create=True, distributed=False) as ck:
        ck.save(1, {"w": {f"t{i}": torch.full((4,), float(i)) for i in range(16384)}}).wait()
    path, offset = _flip_in_manifest(root, b'"off":', 6)
    start = time.monotonic()
    (p,) = verify.verify_step(root, 1)
    assert time.monotonic() - start < 60
    assert p.file == path and p.offset is not None and abs(p.offset - offset) <= 20
    assert "first difference from the rank manifests at tensors[0]" in p.message


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet="aé€😀\"\\ x"),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(alphabet="ké€", max_size=3), inner, max_size=4),
    max_leaves=20)


@hsettings(max_examples=200, deadline=None)
@given(_JSON, st.sampled_from([None, 1, 2]))
def test_positions_are_the_byte_offsets_of_every_value(doc, indent):
    """verify's one-pass parser: each value's byte offset, with any non-ASCII text before it."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    parsed, where = verify._positions(text)
    assert parsed == doc
    raw = text.encode()
    for path, offset in where.items():
        value = doc
        for key in path:
            value = value[key]
        got, _ = json.JSONDecoder().raw_decode(raw[offset:].decode())
        assert got == value, path


def test_diff_reports_which_tensors_and_by_how_much(tmp_path, capsys):
    a = make_root(str(tmp_path / "a"), steps=(1,))
    m, opt = _model(0)
    with torch.no_grad():
        m[0].weight[0, :3] += 0.5
    with Checkpointer(str(tmp_path / "b"), keep=0, create=True, distributed=False) as ck:
        ck.save(1, {"model": m, "optim": opt, "step": 7, "note": "x"},
                {"rng": torch.get_rng_state()}).wait()
    rc, doc = run_json(capsys, "ckpt", "diff", a, str(tmp_path / "b"))
    assert rc == 1 and not doc["equal"]
    changed = {t["name"]: t for t in doc["tensors"] if t["status"] != "equal"}
    assert list(changed) == ["model/0.weight"]
    w = changed["model/0.weight"]
    assert w["differing"] == 3 and w["numel"] == 128
    assert w["max_abs_diff"] == pytest.approx(0.5, rel=1e-5)
    assert doc["values"] == [{"path": "step", "a": 1, "b": 7}]
    assert run_cli(capsys, "ckpt", "diff", a, a)[0] == 0
    rc, out, _ = run_cli(capsys, "ckpt", "diff", a, str(tmp_path / "b"))
    assert rc == 1 and "model/0.weight" in out and "3/128" in out


@pytest.mark.parametrize("kind", ["missing", "file", "garbage", "dcp", "step"])
def test_user_errors_exit_2_naming_the_path(tmp_path, kind, root, capsys):
    path = str(tmp_path / "p")
    if kind == "file":
        open(path, "w").close()
    elif kind == "garbage":
        os.makedirs(path)
        with open(os.path.join(path, "junk.txt"), "w") as f:
            f.write("x")
    elif kind == "dcp":
        os.makedirs(path)
        open(os.path.join(path, ".metadata"), "w").close()
    if kind == "step":
        commands = [["show", root, "--step", "99"], ["verify", root, "--step", "99"]]
    else:
        commands = [["ls", path], ["show", path], ["verify", path], ["diff", path, root],
                    ["export", path, str(tmp_path / "o"), "--format", "torch"]]
    for argv in commands:
        rc, out, err = run_cli(capsys, "ckpt", *argv)
        assert rc == 2, (argv, err)
        assert (root if kind == "step" else path) in err
        assert err.startswith(f"resilient ckpt {argv[0]}: error: ") and not out
        rc, out, err = run_cli(capsys, "ckpt", *argv, "--json")  # scripts get JSON too
        doc = json.loads(out)
        assert rc == 2 and doc["command"] == argv[0] and doc["error"] in err


def test_root_without_steps(tmp_path, capsys):
    root = str(tmp_path / "empty")
    Checkpointer(root, create=True, distributed=False).close()
    rc, doc = run_json(capsys, "ckpt", "ls", root)
    assert rc == 0 and doc["steps"] == [] and doc["head"] is None
    rc, out, err = run_cli(capsys, "ckpt", "show", root)
    assert rc == 2 and "holds no committed step" in err and root in err


def test_export_refuses_to_overwrite(root, tmp_path, capsys):
    out = tmp_path / "o.pt"
    out.write_bytes(b"keep me")
    rc, _, err = run_cli(capsys, "ckpt", "export", root, str(out), "--format", "torch")
    assert rc == 2 and "already exists" in err and out.read_bytes() == b"keep me"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").write_bytes(b"x")
    rc, _, err = run_cli(capsys, "ckpt", "export", root, str(tmp_path / "d"), "--format",
                         "safetensors")
    assert rc == 2 and "already holds model.safetensors" in err


def test_verify_names_the_dcp_metadata_file_as_dcp_metadata_does():
    from resilient.checkpoint import dcp_metadata

    assert verify.DCP_METADATA == dcp_metadata.FILE


def test_progress_reports_without_tqdm(monkeypatch):
    import io

    from resilient.cli import ckpt

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails: the simple line
    stream = io.StringIO()
    report = ckpt.make_progress(stream)
    report(1, 2, "steps")
    report(2, 2, "steps")
    assert stream.getvalue() == "\rsteps: 1/2\rsteps: 2/2\n"


def test_progress_bar_with_tqdm():
    import io

    pytest.importorskip("tqdm")
    from resilient.cli import ckpt

    stream = io.StringIO()
    report = ckpt.make_progress(stream)
    for i in range(1, 4):
        report(i, 3, "tensors")
    assert "tensors:   0%" in stream.getvalue() and "0/3" in stream.getvalue()
    assert stream.getvalue().endswith("\r")  # erased when done (leave=False)
