"""A DDP job under ``resilient run`` that checkpoints every step through a CheckpointManager
handed to Recovery, with 32 MiB of state so that a save is nearly always in flight: a rank
killed at any moment leaves survivors whose saves wait for it (test_quickstart_recovery.py).

    python -m resilient.run --standalone --nproc-per-node 4 ddp_saving_every_step.py CKPT OUT N

With RESILIENT_TEST_DEVICE=cuda each rank trains on GPU LOCAL_RANK over NCCL (the checkpoint's
32 MiB stays in host memory).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient import CheckpointManager, Recovery

ckpt_root, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
torch.set_num_threads(1)
device = torch.device("cpu")
if os.environ.get("RESILIENT_TEST_DEVICE") == "cuda":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
me = dist.get_rank()
model = DDP(torch.nn.Linear(64, 64).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
bulk = torch.zeros(8 * 1024 * 1024)  # 32 MiB written once per save, split over the ranks
ckpt = CheckpointManager(ckpt_root, {"model": model, "optim": opt, "bulk": bulk}, every=1,
                         create=True)
rec = Recovery.adopt(model, opt, checkpointer=ckpt)
with open(os.path.join(out, f"rank{me}.pid"), "w") as f:
    f.write(str(os.getpid()))
for step in rec.steps(ckpt.restore(), steps):
    with rec.attempt():
        opt.zero_grad()
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).to(device)
        rec.model(x).square().mean().backward()
        opt.step()
        bulk.add_(1.0)
    with open(os.path.join(out, f"rank{me}.step"), "w") as f:
        f.write(str(rec.step))
ckpt.close()
print(f"rank {me}: done at step {rec.step}, world {rec.world_size}", flush=True)
