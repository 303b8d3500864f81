"""GPU checkpointing (runs on a machine with CUDA; skipped here with the reason)."""

from __future__ import annotations

import random

import pytest
import torch

import resilient

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def rand(shape, dtype, device):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-100, 100, shape, device=device).to(dtype)


@pytest.mark.parametrize("mode", ["blocking", "overlap"])
def test_gpu_round_trip_bit_exact(tmp_path, mode):
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    state = {}
    for d in devices:
        for dt in DTYPES:
            state[f"{d}/{dt}"] = rand((1031, 257), dt, d)
        base = torch.randn(64, 48, device=d)
        state[f"{d}/view_t"] = base.t()
        state[f"{d}/view_strided"] = base[::3, 1::2]
        state[f"{d}/0d"] = torch.tensor(3.5, device=d)
        state[f"{d}/empty"] = torch.empty(0, 7, device=d)
    expected = {k: v.clone() for k, v in state.items()}
    with resilient.Checkpointer(tmp_path) as ckpt:
        h = ckpt.save(1, state, mode=mode)
        h.wait_snapshot()
        for t in state.values():
            if t.numel() and t.dtype != torch.bool:
                t.add_(1)  # changed after the snapshot fence
        h.wait()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.load(out) == 1
        cpu = {k: torch.zeros_like(v, device="cpu") for k, v in state.items()}
        assert ckpt.load(cpu) == 1
    for k, v in expected.items():
        assert out[k].device == v.device
        assert torch.equal(bits(out[k]), bits(v)), k
        assert torch.equal(bits(cpu[k]), bits(v)), k


@pytest.mark.parametrize("mode", ["blocking", "overlap"])
def test_a_save_under_another_stream_copies_after_that_streams_work(tmp_path, mode):
    """The second save reuses the first one's tensor descriptors; its copies must still wait for
    the stream current at the second save (here a side stream whose write is still pending)."""
    x = torch.zeros(1 << 24, device="cuda")
    with resilient.Checkpointer(tmp_path) as ck:
        ck.save(1, {"x": x}, mode=mode).wait()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles before the write
            x.fill_(7.0)
            h = ck.save(2, {"x": x}, mode=mode)
        h.wait()
        out = {"x": torch.zeros(x.shape)}
        assert ck.load(out, step=2) == 2
    assert bool(torch.all(out["x"] == 7.0))


def test_overlap_mode_in_a_training_loop_holds_the_saved_step(tmp_path):
    """optimizer.step() every iteration, overlapped saves at random steps with random extra work:
    every checkpoint equals a copy of the parameters taken at its step."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    copies = {}
    with resilient.Checkpointer(tmp_path, keep=100) as ckpt:
        ckpt.attach(opt)
        handles = []
        for step in range(60):
            x = torch.randn(256, 512, device="cuda")
            loss = model(x).pow(2).mean()
            if rng.random() < 0.3:
                copies[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                handles.append(ckpt.save(step, {"model": model}, mode="overlap"))
            for _ in range(rng.randrange(3)):
                torch.matmul(x, x.t())  # random extra work on the stream
            loss.backward()
            opt.step()
            opt.zero_grad()
        for h in handles:
            h.wait()
        assert len(copies) >= 5
        for step, expected in copies.items():
            fresh = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).cuda()
            assert ckpt.load({"model": fresh}, step=step) == step
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, expected[k]), (step, k)


@pytest.mark.parametrize("mode", ["blocking", "overlap"])
@pytest.mark.parametrize("save_as", ["objects", "state_dicts"])
@pytest.mark.parametrize("load_as", ["objects", "state_dicts", "empty"])
def test_gpu_idiom_matrix(tmp_path, mode, save_as, load_as):
    """The load contract on CUDA tensors: objects or state dicts on either side, bit-exact,
    and a target that does not fit raises with nothing modified."""
    from torch import nn

    def make(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return m, o

    m, o = make(0)
    for _ in range(2):
        m(torch.randn(16, 64, device="cuda")).square().mean().backward()
        o.step()
    state = {"model": m, "optim": o} if save_as == "objects" else {
        "model": m.state_dict(), "optim": o.state_dict()}
    m2, o2 = make(1)
    m2(torch.randn(16, 64, device="cuda")).square().mean().backward()
    o2.step()  # optimizer state exists, on the GPU
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        ck.save(1, state, mode=mode).wait()
        if load_as == "objects":
            assert ck.load({"model": m2, "optim": o2}) == 1
        elif load_as == "state_dicts":
            sd = {"model": m2.state_dict(), "optim": o2.state_dict()}
            assert ck.load(sd) == 1
            o2.load_state_dict(sd["optim"])
        else:
            out: dict = {}
            assert ck.load(out) == 1
            m2.load_state_dict(out["model"])
            o2.load_state_dict(out["optim"])
        for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
            assert torch.equal(bits(a), bits(b)), k
        for p, q in zip(o.state_dict()["state"].values(), o2.state_dict()["state"].values()):
            assert all(torch.equal(bits(p[k]), bits(q[k])) for k in p)
        m3, o3 = make(2)
        wrong = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8)).cuda()
        before = [t.clone() for t in wrong.state_dict().values()]
        with pytest.raises(resilient.IncompatibleCheckpointError, match="model/0.weight"):
            ck.load({"model": wrong, "optim": o3})
        assert all(torch.equal(a, b) for a, b in zip(before, wrong.state_dict().values()))


FSDP_GPU = """
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import resilient
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.manual_seed(0)
def build():
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)
m, o = build()
def step():
    m(torch.randn(8, 64, device="cuda")).square().mean().backward(); o.step(); o.zero_grad()
step()
with resilient.Checkpointer(sys.argv[1], create=True) as ck:
    h = ck.save(1, {"model": m, "optim": o}, mode="overlap")
    h.wait_snapshot()
    saved = {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
    step()  # changes every parameter after the snapshot: the checkpoint keeps step 1's
    h.wait()
    m2, o2 = build()
    assert ck.load({"model": m2, "optim": o2}) == 1
    same = all(torch.equal(saved[k], v.full_tensor()) for k, v in m2.state_dict().items())
    m, o = m2, o2
    step()  # the fresh optimizer's state was created sharded, on the GPU
    print("FSDP-GPU", same, next(iter(o2.state.values()))["exp_avg"].device)
dist.destroy_process_group()
"""


def test_fsdp2_on_the_gpu_overlap_save_and_fresh_load(tmp_path, free_port):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FSDP_GPU, str(tmp_path / "c"), str(free_port)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FSDP-GPU True cuda:0" in out.stdout, out.stdout


FSDP_CROSS_DEVICE = """
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import resilient
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
def build(device, seed):
    torch.manual_seed(seed)
    mesh = init_device_mesh(device, (1,))
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 16, device=device)).square().mean().backward(); o.step(); o.zero_grad()
    return m, o
def full(m, o):
    out = {k: v.full_tensor().cpu() for k, v in m.state_dict().items()}
    for i, s in enumerate(o.state.values()):
        out.update({f"{i}.{k}": v.full_tensor().cpu() if hasattr(v, "full_tensor") else v.cpu()
                    for k, v in s.items()})
    return out
with resilient.Checkpointer(sys.argv[1], create=True) as ck:
    for src, dst, step in (("cuda", "cpu", 1), ("cpu", "cuda", 2)):
        m, o = build(src, 0)
        ck.save(step, {"model": m, "optim": o}).wait()
        m2, o2 = build(dst, 5)
        assert ck.load({"model": m2, "optim": o2}) == step
        a, b = full(m, o), full(m2, o2)
        print("CROSS", src, dst, a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
              next(iter(m2.parameters())).device.type)
dist.destroy_process_group()
"""


def test_fsdp2_state_moves_between_a_cuda_and_a_cpu_mesh(tmp_path, free_port):
    """A checkpoint of an FSDP2 model on a CUDA mesh loads onto a CPU mesh and back."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FSDP_CROSS_DEVICE, str(tmp_path / "c"),
                          str(free_port)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CROSS cuda cpu True cpu" in out.stdout and "CROSS cpu cuda True cuda" in out.stdout, \
        out.stdout
