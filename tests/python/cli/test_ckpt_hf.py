"""A Hugging Face model trained with resilient exports to a directory that transformers'
`from_pretrained` loads with identical tensors (GPT-2, random init, nothing downloaded)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from resilient.checkpoint import Checkpointer, catalog
from resilient.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("shard", [None, "100KB"])
def test_gpt2_export_loads_with_from_pretrained(tmp_path, capsys, shard):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    root = str(tmp_path / "root")
    with Checkpointer(root, create=True, distributed=False) as ck:
        ck.save(3, {"model": model, "optim": opt, "step": 3}).wait()
    model.config.save_pretrained(str(tmp_path / "cfg"))
    out = str(tmp_path / "hf")
    argv = ["ckpt", "export", root, out, "--format", "safetensors", "--key", "model",
            "--hf-config", str(tmp_path / "cfg"), "--json"]
    if shard:
        argv += ["--max-shard-size", shard]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["hf_files"] == ["config.json"]
    index = os.path.join(out, "model.safetensors.index.json")
    assert os.path.exists(index) == bool(shard)
    if shard:
        assert len(summary["files"]) > 2
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("what", ["directory", "file"])
def test_save_pretrained_directory_imports_and_loads_strictly(tmp_path, capsys, what):
    """The directory, or its model.safetensors (README's form: config.json is beside it)."""
    model = _gpt2()
    model.save_pretrained(str(tmp_path / "hf"))  # lm_head.weight is left out (tied)
    root = str(tmp_path / "root")
    src = tmp_path / "hf" if what == "directory" else tmp_path / "hf" / "model.safetensors"
    assert main(["ckpt", "import", str(src), root, "--key", "model", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tied"] == ["lm_head.weight"]
    assert summary["tensors"] == catalog.describe_step(root)["tensor_count"]  # written ones
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(model.config)
    with Checkpointer(root, distributed=False) as ck:
        assert ck.load({"model": fresh}) == 0  # strict
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
