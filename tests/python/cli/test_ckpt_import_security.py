"""`resilient ckpt import` takes untrusted files: nothing in them runs (a pickle that would
create a file is refused, and the file is not created), nothing outside the source is read,
no tensor is dropped or swapped for another copy, and malformed input is one line and exit 2
(issue 50, items 9, 10 and 12; docs/SECURITY.md, "The import path")."""


from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint import Checkpointer, catalog, convert
from resilient.cli import main

safetensors_torch = pytest.importorskip("safetensors.torch")


def _dcp_save(state: dict, path: str) -> str:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def test_a_foreign_dcp_checkpoint_reads_as_torchs_reader_reads_it(tmp_path):
    """Model, optimizer (param_groups: floats, tuples, lists, None, bools), plain values and
    bytes come back as DCP's own loader returns them."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from resilient.checkpoint import sources

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    src = _dcp_save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7,
                     "note": "x", "blob": b"\x00\xff", "ids": [3, 1]}, str(tmp_path / "dcp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _load_state_dict_from_keys(checkpoint_id=src)
    got = sources.read_dcp(src)
    _assert_same(got, expected, "")
    assert main(["ckpt", "import", src, str(tmp_path / "root"), "--key", "train"]) == 0


def _assert_same(a, b, path: str) -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _sharded_export(tmp_path) -> str:
    """A whole-state safetensors export in three files with an index."""
    root = str(tmp_path / "src")
    with Checkpointer(root, keep=0, create=True, distributed=False) as ck:
        ck.save(3, {"a": torch.arange(64.0), "b": torch.ones(64), "c": torch.zeros(64)}).wait()
    out = str(tmp_path / "hf")
    convert.export_checkpoint(root, out, "safetensors", max_shard_size=300)
    return out


def _index(out: str) -> dict:
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        return json.load(f)


def _rewrite(path: str, change) -> None:
    """Rewrites a safetensors file through `change(tensors) -> tensors`, metadata kept."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    safetensors_torch.save_file(change(tensors), path, metadata=meta)


def test_a_tensor_the_index_names_but_its_file_lacks_is_refused(tmp_path):
    out = _sharded_export(tmp_path)
    path = os.path.join(out, _index(out)["weight_map"]["b"])
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != "b"} or {"x": torch.ones(1)})
    assert main(["ckpt", "import", out, str(tmp_path / "root")]) == 2


def test_the_same_key_in_two_files_without_an_index_is_refused(tmp_path, capsys):
    src = tmp_path / "dir"
    src.mkdir()
    safetensors_torch.save_file({"w": torch.ones(2)}, str(src / "a.safetensors"))
    safetensors_torch.save_file({"w": torch.zeros(2)}, str(src / "b.safetensors"))
    assert main(["ckpt", "import", str(src), str(tmp_path / "root"), "--key", "m"]) == 2
    assert "tensor 'w' is in both" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_the_summary_counts_the_tensors_written(tmp_path, capsys, fmt):
    root = str(tmp_path / "src")
    with Checkpointer(root, keep=0, create=True, distributed=False) as ck:
        ck.save(3, {"a": torch.arange(4.0), "b": {"c": torch.ones(2)}},
                {"r": torch.zeros(1)}).wait()
    out = str(tmp_path / ("w.pt" if fmt == "torch" else "out"))
    convert.export_checkpoint(root, out, fmt)
    assert main(["ckpt", "import", out, str(tmp_path / "back"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact"] and summary["tensors"] == 3
    assert catalog.describe_step(str(tmp_path / "back"))["tensor_count"] == 3


_BYTES = st.binary(max_size=300)


def _fuzz(tmp_path_factory, name: str, data: bytes, directory: bool) -> None:
    base = tmp_path_factory.mktemp("fuzz")
    src = base / "src"
    if directory:
        src.mkdir()
        (src / name).write_bytes(data)
        safetensors_torch.save_file({"w": torch.ones(1)}, str(src / "x.safetensors"))
    else:
        src = base / name
        src.write_bytes(data)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["ckpt", "import", str(src), str(base / "root"), "--key", "m"])
    assert rc in (0, 2), err.getvalue()  # an exception escaping main() fails the test too
    if rc == 2:
        assert err.getvalue().count("\n") == 1 and "Traceback" not in err.getvalue()


@settings(max_examples=60, deadline=None)
@given(data=_BYTES, header=st.integers(0, 400))
def test_any_safetensors_bytes_are_read_or_refused_in_one_line(tmp_path_factory, data, header):
    _fuzz(tmp_path_factory, "w.safetensors", header.to_bytes(8, "little") + data, False)


@settings(max_examples=60, deadline=None)
@given(data=_BYTES)
def test_any_dcp_metadata_bytes_are_refused_in_one_line(tmp_path_factory, data):
    _fuzz(tmp_path_factory, ".metadata", pickle.dumps(data)[:2] + data, True)


_INDEXES = st.recursive(st.none() | st.integers() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.sampled_from(["weight_map", "metadata", "w",
                                                           "_resilient"]), inner, max_size=3),
                        max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(doc=_INDEXES)
def test_any_index_json_is_read_or_refused_in_one_line(tmp_path_factory, doc):
    _fuzz(tmp_path_factory, "model.safetensors.index.json", json.dumps(doc).encode(), True)
