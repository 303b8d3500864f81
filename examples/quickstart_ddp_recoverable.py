"""examples/quickstart_ddp.py made to survive a lost rank in the same processes: the lines
marked "# resilient" are the whole change (docs/recovery.md shows the diff). When a rank dies,
the survivors agree on it, rebuild the group, redo the interrupted step, re-split the rest of the
epoch over themselves, and the CheckpointManager goes on saving from the new group.

    resilient run --standalone --nproc-per-node 4 examples/quickstart_ddp_recoverable.py \
        --ckpt /tmp/qs          # kill -9 one worker: the other three finish

(torchrun would kill the survivors; `resilient run` takes the same arguments and keeps them.)
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import CheckpointManager, Recovery, ResumableSampler, forever  # resilient

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
rec = Recovery.adopt(ddp_model, opt, checkpointer=ckpt, samplers=[sampler])  # resilient
batches = forever(loader)                                                    # resilient
for step in rec.steps(step, total_steps):                                    # resilient
    with rec.attempt():              # a peer lost: agree, rebuild, redo        resilient
        xb, yb, index = next(batches)                                        # resilient
        opt.zero_grad()
        torch.nn.functional.mse_loss(rec.model(xb), yb).backward()           # resilient
        opt.step()
        sched.step()
        if args.sample_log:  # the samples of step `step` (0-based), for the tests
            with open(os.path.join(args.sample_log, f"rank{me}.samples"), "a") as f:
                f.write(json.dumps([step, os.getpid(), index.tolist()]) + "\n")
ckpt.close()
dist.destroy_process_group()
