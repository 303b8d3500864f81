"""The README's "distributed training, exact resume" quick start as a script: DDP, a DataLoader
over ResumableSampler(DistributedSampler), a CheckpointManager saving every 5 steps.

    torchrun --standalone --nproc-per-node 4 examples/quickstart_ddp.py --ckpt /tmp/qs

examples/quickstart_ddp_recoverable.py is the same script made to survive a lost rank in the
same processes (docs/recovery.md shows the diff). --sample-log DIR writes, per rank, the indices
of the samples each completed step trained on (DIR/rank<R>.samples, one JSON line per step).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import CheckpointManager, ResumableSampler, forever

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--sample-log", default="")
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
dist.init_process_group("gloo")
me = dist.get_rank()  # this process's first rank: names its sample log
x = torch.randn(960, 16, generator=torch.Generator().manual_seed(1))
dataset = TensorDataset(x, x[:, :4].sum(1, keepdim=True), torch.arange(len(x)))
ddp_model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
total_steps = args.steps

sampler = ResumableSampler(DistributedSampler(dataset, seed=0))
loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=torch.Generator())
ckpt = CheckpointManager(args.ckpt, {"model": ddp_model, "optim": opt, "sched": sched},
                         rank_state={"sampler": sampler}, every=5, create=True)
step = ckpt.restore()                 # 0 on a fresh start; RNG, sampler and step come back too
for batch in forever(loader):
    xb, yb, index = batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp_model(xb), yb).backward()
    opt.step()
    sched.step()
    if args.sample_log:  # the samples of step `step` (0-based), for the tests
        with open(os.path.join(args.sample_log, f"rank{me}.samples"), "a") as f:
            f.write(json.dumps([step, os.getpid(), index.tolist()]) + "\n")
    step += 1
    ckpt.step(step)                   # every 5 steps: each rank writes ~1/N, one commit
    if step == total_steps:
        break
ckpt.close()
dist.destroy_process_group()
