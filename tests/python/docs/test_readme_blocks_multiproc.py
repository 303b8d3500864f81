"""The README's code blocks, taken from README.md and run as written (issue 44, item 2).

Each block is extracted from the file; only its placeholders are filled (the training step's
``...``, paths, the number of steps). A run is killed mid-way and resumed; the resumed run's
final weights must equal an uninterrupted run's, bit for bit.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_readme_blocks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from test_readme_blocks import README

from doc_blocks import block_with, substitute

# -- "Quick start: checkpoints" -------------------------------------------------------------
SINGLE_PRELUDE = """
import os
import torch

def train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 1024, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    if step + 1 == int(os.environ.get("KILL_AFTER", -1)):
        ckpt.wait()            # the last periodic save is committed
        os._exit(9)            # then the process dies, as with kill -9
"""


SINGLE_END = """
torch.save({k: v for k, v in model.state_dict().items()}, os.environ["OUT"])
print("started at", os.environ.get("STARTED"))
"""


def _single_script(root: Path) -> str:
    block = block_with(README, "resilient.Checkpointer(")
    code = substitute(
        block,
        ('"/lustre/ckpt/run42"', repr(str(root))),
        ("    ...  # forward, backward, opt.step()", "    train_step(model, opt, step)"),
        ("while step < 10_000:", "while step < 25:"),
        ("step % 100 == 0", "step % 5 == 0"),
        ('or 0   # steps done; None: a fresh root',
         'or 0   # steps done; None: a fresh root\nos.environ["STARTED"] = str(step)'),
    )
    return SINGLE_PRELUDE + "torch.manual_seed(0)\n" + code + SINGLE_END


def _run(script: str, tmp: Path, name: str, env: dict) -> tuple[int, str]:
    path = tmp / f"{name}.py"
    path.write_text(script)
    rc, out, err = _run_env([sys.executable, str(path)], env)
    return rc, out + err


def _run_env(args: list[str], env: dict) -> tuple[int, str, str]:
    p = subprocess.run(args, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    return p.returncode, p.stdout, p.stderr


def test_the_single_process_quick_start_resumes_exactly(tmp_path):
    whole = tmp_path / "whole.pt"
    rc, out = _run(_single_script(tmp_path / "a"), tmp_path, "whole", {"OUT": str(whole)})
    assert rc == 0, out
    resumed = tmp_path / "resumed.pt"
    script = _single_script(tmp_path / "b")
    rc, out = _run(script, tmp_path, "killed", {"OUT": str(resumed), "KILL_AFTER": "13"})
    assert rc == 9, out
    rc, out = _run(script, tmp_path, "resumed", {"OUT": str(resumed)})
    assert rc == 0, out
    assert "started at 10" in out  # the save after step 10, committed before the kill
    a, b = torch.load(whole), torch.load(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- "Quick start: distributed training, exact resume" --------------------------------------
DDP_PRELUDE = """
import hashlib, json, os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.manual_seed(0)
torch.set_num_threads(1)
dist.init_process_group("gloo")
x = torch.randn(400, 16, generator=torch.Generator().manual_seed(1))
dataset = TensorDataset(x, x[:, :4].sum(1, keepdim=True))
ddp_model = DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(ddp_model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
total_steps = 30

def train(batch):
    xb, yb = batch
    noise = torch.rand(1).item()      # the RNG streams come back on resume too
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp_model(xb) * (1 + noise * 1e-3), yb).backward()
    opt.step()
    sched.step()

def maybe_die(step):
    if step == int(os.environ.get("KILL_AT", -1)) and dist.get_rank() == 1:
        ckpt.wait()
        os._exit(9)
"""


DDP_END = """
if dist.get_rank() == 0:
    with open(os.environ["OUT"], "w") as f:
        json.dump({"started": started, "params": {
            k: hashlib.sha256(v.detach().numpy().tobytes()).hexdigest()
            for k, v in ddp_model.module.state_dict().items()}}, f)
dist.destroy_process_group()
"""


def _ddp_script(root: Path) -> str:
    block = block_with(README, "CheckpointManager(")
    code = substitute(
        block,
        ('"/shared/ckpt"', repr(str(root))),
        ("every=100", "every=4"),
        ("    ...                               # forward, backward, opt.step(), sched.step()",
         "    train(batch)"),
        ("    ckpt.step(step)", "    maybe_die(step)\n    ckpt.step(step)"),
        ("step = ckpt.restore()", "step = ckpt.restore()\nstarted = step"),
    )
    return DDP_PRELUDE + code + DDP_END


def _torchrun(script: Path, env: dict) -> tuple[int, str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(script)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    return p.returncode, p.stdout + p.stderr


def test_the_ddp_quick_start_resumes_exactly_under_torchrun(tmp_path):
    whole, resumed = tmp_path / "whole.json", tmp_path / "resumed.json"
    (tmp_path / "a.py").write_text(_ddp_script(tmp_path / "a"))
    (tmp_path / "b.py").write_text(_ddp_script(tmp_path / "b"))
    rc, out = _torchrun(tmp_path / "a.py", {"OUT": str(whole)})
    assert rc == 0, out[-4000:]
    rc, out = _torchrun(tmp_path / "b.py", {"OUT": str(resumed), "KILL_AT": "11"})
    assert rc != 0, out[-4000:]
    rc, out = _torchrun(tmp_path / "b.py", {"OUT": str(resumed)})
    assert rc == 0, out[-4000:]
    a, b = json.loads(whole.read_text()), json.loads(resumed.read_text())
    assert (a["started"], b["started"]) == (0, 8)
    assert a["params"] == b["params"]


# -- the other blocks -------------------------------------------------------------------------
def test_the_dcp_block_saves_and_loads(tmp_path):
    block = block_with(README, "ResilientStorageWriter(")
    root = str(tmp_path / "run42")
    code = block.code.replace('"/ckpt/run42', '"' + root)
    assert code.count(root) == 4, code
    prelude = textwrap.dedent("""
        import torch
        import torch.distributed.checkpoint as dcp
        state = {"w": torch.arange(8.0), "step": 1200}
    """)
    end = textwrap.dedent(f"""
        import resilient
        with resilient.Checkpointer({root!r}) as ck:
            assert ck.lineage() == [1201, 1200], ck.lineage()
        got = {{"w": torch.zeros(8), "step": 0}}
        dcp.load(got, storage_reader=ResilientStorageReader({root!r}))
        assert torch.equal(got["w"], torch.arange(8.0)) and got["step"] == 1200, got
        print("ok")
    """)
    path = tmp_path / "dcp_block.py"
    path.write_text(prelude + code + end)
    rc, out, err = _run_env([sys.executable, str(path)], {})
    assert rc == 0 and "ok" in out, out + err
