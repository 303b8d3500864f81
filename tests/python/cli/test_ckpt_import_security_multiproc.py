"""`resilient ckpt import` takes untrusted files: nothing in them runs (a pickle that would
create a file is refused, and the file is not created), nothing outside the source is read,
no tensor is dropped or swapped for another copy, and malformed input is one line and exit 2
(issue 50, items 9, 10 and 12; docs/SECURITY.md, "The import path").

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_ckpt_import_security.py."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from test_ckpt_import_security import (
    _dcp_save,
    _index,
    _rewrite,
    _sharded_export,
    safetensors_torch,
)

from resilient.checkpoint import Checkpointer, convert


class MakesADirectory:
    """Unpickling this calls os.mkdir(path): what a hostile checkpoint would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def run_import(*argv: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "resilient", "ckpt", "import", *argv],
                          capture_output=True, text=True, timeout=300)


def assert_refused(p: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line on stderr saying why, no traceback."""
    assert p.returncode == 2, p
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("resilient ckpt import: error: "), p.stderr
    for needle in needles:
        assert needle in p.stderr, (needle, p.stderr)


def _torch_dcp_reader_runs(src: str) -> None:
    """Control: torch's own DCP reader, in a child process (it runs the pickle)."""
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from torch.distributed.checkpoint.state_dict_loader import "
            "_load_state_dict_from_keys\n"
            f"_load_state_dict_from_keys(checkpoint_id={src!r})\n")
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)


# -- item 9: nothing runs ------------------------------------------------------------------
@pytest.mark.parametrize("where", ["the whole file", "inside real metadata"])
def test_pickled_metadata_that_would_run_code_is_refused(tmp_path, where):
    src = _dcp_save({"w": torch.arange(6.0)}, str(tmp_path / "dcp"))
    marker = tmp_path / "ran"
    if where == "the whole file":
        payload = MakesADirectory(str(marker))
    else:
        from torch.distributed.checkpoint import FileSystemReader

        payload = FileSystemReader(src).read_metadata()
        payload.storage_meta.checkpoint_id = MakesADirectory(str(marker))
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(payload, f)
    p = run_import(src, str(tmp_path / "root"))
    assert_refused(p, f"{src}/.metadata", "refusing to load posix.mkdir")
    assert not marker.exists() and not (tmp_path / "root").exists()
    _torch_dcp_reader_runs(src)
    assert marker.exists()  # the control: the file is hostile


def test_a_bytes_item_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    src = _dcp_save({"w": torch.arange(6.0), "lr": 0.1, "hook": MakesADirectory(str(marker))},
                    str(tmp_path / "dcp"))
    p = run_import(src, str(tmp_path / "root"), "--key", "model")
    assert_refused(p, "refusing the value of 'hook'", "posix.mkdir", "docs/SECURITY.md")
    assert not marker.exists() and not (tmp_path / "root").exists()
    _torch_dcp_reader_runs(src)
    assert marker.exists()  # the control: DCP's reader runs torch.load(weights_only=False)


@pytest.mark.parametrize("value,needle", [
    (frozenset([1]), "cannot save a frozenset without pickle"),  # plain, but not storable
    (1 + 2j, "refusing the value of 'v': it names builtins.complex"),
])
def test_a_dcp_value_the_import_cannot_take_is_one_line_and_exit_2(tmp_path, value, needle):
    src = _dcp_save({"w": torch.ones(2), "v": value}, str(tmp_path / "dcp"))
    assert_refused(run_import(src, str(tmp_path / "root"), "--key", "m"), needle)


# -- item 10: nothing outside the source, nothing dropped or swapped -----------------------
def test_a_dcp_path_outside_the_source_is_refused(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    src = _dcp_save({"w": torch.arange(6.0)}, str(tmp_path / "dcp"))
    md = FileSystemReader(src).read_metadata()
    (info,) = md.storage_data.values()
    os.rename(os.path.join(src, info.relative_path), tmp_path / "outside.distcp")
    info.relative_path = "../outside.distcp"
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    assert_refused(run_import(src, str(tmp_path / "root")), "'../outside.distcp' points outside")


def test_an_index_entry_outside_the_source_is_refused(tmp_path):
    out = _sharded_export(tmp_path)
    index = _index(out)
    first = index["weight_map"]["a"]
    os.rename(os.path.join(out, first), tmp_path / "outside.safetensors")
    index["weight_map"]["a"] = "../outside.safetensors"
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert_refused(run_import(out, str(tmp_path / "root")),
                   "entry 'a'", "'../outside.safetensors' points outside")
    os.symlink(tmp_path / "outside.safetensors", os.path.join(out, first))  # a link out
    index["weight_map"]["a"] = first
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert_refused(run_import(out, str(tmp_path / "root")), f"'{first}' points outside")


def test_a_stale_duplicate_in_another_shard_is_refused_not_picked(tmp_path):
    """The index names a file for "a"; a stale copy of "a" in another file used to win."""
    out = _sharded_export(tmp_path)
    index = _index(out)
    other = next(f for k, f in index["weight_map"].items() if f != index["weight_map"]["a"])
    _rewrite(os.path.join(out, other), lambda t: {**t, "a": torch.full((64,), -1.0)})
    assert_refused(run_import(out, str(tmp_path / "root")),
                   f"{os.path.join(out, other)} holds tensor 'a', which "
                   "model.safetensors.index.json does not give to it")


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_a_tensor_added_to_an_export_is_refused_not_dropped(tmp_path, fmt):
    root = str(tmp_path / "src")
    with Checkpointer(root, keep=0, create=True, distributed=False) as ck:
        ck.save(3, {"a": torch.arange(4.0), "n": 1}).wait()
    out = str(tmp_path / ("w.pt" if fmt == "torch" else "out"))
    convert.export_checkpoint(root, out, fmt)
    extra = torch.full((3,), 7.0)
    if fmt == "safetensors":
        _rewrite(os.path.join(out, "model.safetensors"), lambda t: {**t, "added": extra})
    elif fmt == "torch":
        state = torch.load(out, weights_only=True)
        torch.save({**state, "added": extra}, out)
    else:
        from resilient.checkpoint import sources

        state = sources.read_dcp(out)
        for name in os.listdir(out):
            os.remove(os.path.join(out, name))
        _dcp_save({**state, "added": extra}, out)
    p = run_import(out, str(tmp_path / "root"))
    assert_refused(p, "1 tensor(s) that its export record does not reference ('added')")


# -- item 12: malformed input is one line and exit 2 ---------------------------------------
def _record_file(tmp_path, record) -> str:
    path = str(tmp_path / "model.safetensors")
    meta = {"_resilient": record if isinstance(record, str) else json.dumps(record)}
    safetensors_torch.save_file({"a": torch.ones(2)}, path, metadata=meta)
    return path


@pytest.mark.parametrize("record,needle", [
    ("{not json", "the export record is not JSON"),
    ([1, 2], "the export record is a list"),
    ({"format": "resilient-export/1", "step": 2.5, "state": {}}, "step 2.5 is not a whole"),
    ({"format": "resilient-export/1", "step": True, "state": {}}, "step True is not a whole"),
    ({"format": "resilient-export/1", "step": -1, "state": {}}, "step -1 is not a whole"),
    ({"format": "resilient-export/9", "step": 1, "state": {}}, "format 'resilient-export/9'"),
    ({"format": "resilient-export/1", "step": 1}, "no state"),
    ({"format": "resilient-export/1", "step": 1, "state": {}, "rank_state": 5},
     "rank_state is not a list"),
    ({"format": "resilient-export/1", "step": 1, "state": {"$tensor": [1]}},
     "references tensor"),
    ({"format": "resilient-export/1", "step": 1, "state": {"$npscalar": [1], "value": 1}},
     "malformed export record"),
    ({"format": "resilient-export/1", "step": 1, "state": {"$what": 1}}, "unknown tag"),
])
def test_a_malformed_export_record_is_one_line_and_exit_2(tmp_path, record, needle):
    p = run_import(_record_file(tmp_path, record), str(tmp_path / "root"))
    assert_refused(p, needle)


def test_a_malformed_safetensors_header_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "model.safetensors"
    body = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 99]}}'
    path.write_bytes(len(body).to_bytes(8, "little") + body + b"\0" * 8)
    assert_refused(run_import(str(path), str(tmp_path / "root")),
                   f"{path}: not a readable safetensors file")


@pytest.mark.parametrize("config", ["{", "[1]", '{"architectures": 5}',
                                    '{"architectures": ["GPT2LMHeadModel"], "n_layer": "x"}'])
def test_a_malformed_config_json_is_one_line_and_exit_2(tmp_path, config):
    pytest.importorskip("transformers")
    src = tmp_path / "model"
    src.mkdir()
    safetensors_torch.save_file({"w": torch.ones(2)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(config)
    assert_refused(run_import(str(src), str(tmp_path / "root"), "--key", "model"),
                   "config.json")
