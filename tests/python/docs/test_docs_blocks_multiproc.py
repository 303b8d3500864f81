"""The ```python blocks of docs/*.md that need several processes, taken from the files and run
as written (issue 44): each rank is a Python process running a prelude (the names the block
assumes: a small model, the job's store, a fault at a chosen step), the block with only its
placeholders substituted, and an ending that reports what the test checks against the text
around the block. The job's store is hosted by the test, outside the ranks, as torchrun's or
`resilient run`'s agent hosts it, so a rank can be lost while the others go on.
"""

from __future__ import annotations

import json
import signal

from doc_blocks import RANK_PRELUDE, ROOT, Job, block_with, deadline, startup, substitute

DOCS = ROOT / "docs"

# -- docs/detector.md ------------------------------------------------------------------------
DETECTOR_PRELUDE = '''
import threading

store = job_store()
failed, hung, seen = [], [], threading.Event()
KILL_AT = 10  # rank 2 is killed at this step, once every rank's detector runs


def on_failure(ranks, gen):
    failed.append((sorted(ranks), gen))
    seen.set()


def steps():
    """Steps until the detector reports a failure (the test bounds the run)."""
    step = 0
    while not seen.is_set():
        yield step
        step += 1


done = 0  # steps trained


def train_step():
    global done
    if done == 0:  # once every rank's detector runs, the fault may come
        store.set(f"up/{rank}", "1")
        store.wait([f"up/{r}" for r in range(world_size)])
    if rank == 2 and done == KILL_AT:
        die()
    seen.wait(0.01)  # a 10 ms step
    done += 1


def save():
    pass
'''


def test_detector_agrees_on_a_killed_rank(tmp_path):
    """Three ranks run the block; rank 2 is SIGKILLed mid-loop: both survivors' on_failure
    names rank 2 with the same generation, their loops end, the event logs record it."""
    block = block_with(DOCS / "detector.md", "FailureDetector(store, rank, world_size")
    code = substitute(
        block,
        ("on_failure=lambda ranks, gen: ...", "on_failure=on_failure"),
        ("on_hang=lambda rank, section: ...", "on_hang=lambda rank, section: hung.append("
                                              "(rank, section))"),
        ('event_log="/tmp/detect.jsonl"', 'event_log=f"{OUT}/detect{rank}.jsonl"'),
        ("for step in ...:", "for step in steps():"),
    )
    end = "report(failed=failed, hung=hung)\n"
    with Job(tmp_path, RANK_PRELUDE + DETECTOR_PRELUDE + code + end, 3) as job:
        codes = job.wait(startup(3) + deadline(20))
        assert codes == [0, 0, -signal.SIGKILL], job.logs()
    reports = [job.report(r) for r in (0, 1)]
    assert [r["failed"] for r in reports] == [[[[2], reports[0]["failed"][0][1]]]] * 2, reports
    assert all(not r["hung"] for r in reports), reports
    for r in (0, 1):
        events = [json.loads(x) for x in (tmp_path / f"detect{r}.jsonl").read_text().splitlines()]
        removed = [e["removed"] for e in events if e["kind"] == "generation"]
        assert removed == [[{"rank": 2, "reason": "crash", "section": ""}]], events


# -- docs/recovery.md ------------------------------------------------------------------------
RECOVERY_PRELUDE = """
import torch.nn.functional as F

STEPS, KILL_AT, FEATURES = 10, 4, 16


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def inputs(step):
    \"\"\"The step's global batch (the same on every rank); rank 2 is lost in step KILL_AT.\"\"\"
    if rank == 2 and step == KILL_AT:
        die()
    return torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(step))


def x(step):
    return inputs(step)


def y(step):
    return inputs(step)[:, :4].sum(1, keepdim=True)


def batch(step):  # not through x and y: the written-out loop assigns those names
    xs = inputs(step)
    return xs, xs[:, :4].sum(1, keepdim=True)


loss_fn = F.mse_loss
"""

RECOVERY_END = """
import hashlib
h = hashlib.sha256()
for p in rec.module.parameters():
    h.update(p.detach().contiguous().numpy().tobytes())
report(step=rec.step, world=rec.world_size, params=h.hexdigest(), timeline=rec.timeline.events)
"""


def _recovered(job: Job, steps: int) -> list[dict]:
    """The survivors' reports, checked: rank 2 was killed in step 4, ranks 0 and 1 agreed on
    removing it, rebuilt the group, began step 4 again on it and finished every step with
    identical parameters."""
    codes = job.wait(startup(3) + deadline(60))
    assert codes == [0, 0, -signal.SIGKILL], job.logs()
    reports = [job.report(r) for r in (0, 1)]
    for rep in reports:
        assert (rep["step"], rep["world"]) == (steps, 2), (rep["step"], rep["world"])
        kinds = [e["kind"] for e in rep["timeline"]]
        agreed = [e for e in rep["timeline"] if e["kind"] == "agreed"]
        assert len(agreed) == 1 and agreed[0]["removed"] == [2], agreed
        assert "rebuilt" in kinds and "first_collective" in kinds, kinds
        redone = [e["step"] for e in rep["timeline"] if e["kind"] in ("restored",
                                                                       "first_step_began")]
        assert redone == [4, 4], rep["timeline"]  # the failed step, again on the new group
    assert reports[0]["params"] == reports[1]["params"]
    return reports


def test_recovery_survivors_train_on_in_the_same_processes(tmp_path):
    """The Recovery block (its own store, first group and DDP; rank 0 saving through a
    Checkpointer(distributed=False)) on 3 ranks, rank 2 killed in step 4: the survivors
    finish on a group of 2, print the timeline, and the last checkpoint holds their final
    parameters."""
    block = block_with(DOCS / "recovery.md", "checkpointer=Checkpointer(root, distributed=False)")
    code = substitute(block, ("checkpoint_every=100", "checkpoint_every=5"),
                      ("end=10_000", "end=STEPS"))
    prelude = RECOVERY_PRELUDE + """
from resilient import Checkpointer

store = job_store()
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
root = os.path.join(OUT, "ckpt")
"""
    with Job(tmp_path, RANK_PRELUDE + prelude + code + RECOVERY_END, 3) as job:
        reports = _recovered(job, 10)
    assert '"kind": "agreed"' in (tmp_path / "rank0.log").read_text()  # the printed timeline
    import hashlib

    import resilient

    with resilient.Checkpointer(tmp_path / "ckpt", distributed=False) as ck:
        assert ck.lineage()[0] == 10, ck.lineage()
        saved = {"model": {}, "optimizer": None, "extra": None}  # {}, None: whatever was saved
        assert ck.load(saved) == 10
    h = hashlib.sha256()
    for t in saved["model"].values():
        h.update(t.contiguous().numpy().tobytes())
    assert h.hexdigest() == reports[0]["params"]


ADOPT_PRELUDE = RECOVERY_PRELUDE + """
from torch.nn.parallel import DistributedDataParallel as DDP
from resilient import Recovery

steps = STEPS
"""


def test_recovery_adopt_takes_the_scripts_group_and_ddp(tmp_path):
    """The torchrun-style block (init_process_group, DDP, then Recovery.adopt and rec.run) on
    3 ranks of env://, the store outside the ranks: rank 2 killed, the others finish."""
    block = block_with(DOCS / "recovery.md", "rec = Recovery.adopt(model, opt, global_batch=32")
    script = RANK_PRELUDE + ADOPT_PRELUDE + block.code + RECOVERY_END
    with Job(tmp_path, script, 3) as job:
        _recovered(job, 10)


def test_recovery_attempt_redoes_the_failed_step_on_the_new_group(tmp_path):
    """The written-out loop (rec.steps, rec.attempt, rec.micro_batches), after the set-up
    lines of the adopt block above it and a scheduler: rank 2 killed in step 4, the failure
    suppressed, step 4 yielded again on the new group, every step done."""
    adopt = block_with(DOCS / "recovery.md", "rec = Recovery.adopt(model, opt, global_batch=32")
    setup = adopt.code[:adopt.code.index("with rec:")]
    block = block_with(DOCS / "recovery.md", "x, y = batch(step)")
    code = setup + "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)\n"
    with Job(tmp_path, RANK_PRELUDE + ADOPT_PRELUDE + code + block.code + RECOVERY_END,
             3) as job:
        _recovered(job, 10)


SAMPLER_PRELUDE = """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from resilient import Recovery, ResumableSampler, forever

dist.init_process_group("gloo")
model = DDP(make_model())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gb, micro_batch, steps, SAMPLES = 48, 8, 15, 480  # an epoch: 10 steps on 3 ranks or on 2
features = torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(1))
# the targets carry each sample's index, which loss_fn logs
dataset = TensorDataset(features, torch.stack([features[:, :4].sum(1),
                                               torch.arange(SAMPLES).double()], 1))
log = open(os.path.join(OUT, f"samples{rank}.jsonl"), "a")


def loss_fn(out, target):
    if rank == 2 and rec.step == KILL_AT:
        die()
    log.write(json.dumps([rec.step, rec.world_size, target[:, 1].long().tolist()]) + "\\n")
    log.flush()
    return F.mse_loss(out, target[:, :1].float())
"""


def test_recovery_samplers_use_every_sample_of_the_epoch_once(tmp_path):
    """The DataLoader loop over ResumableSampler(DistributedSampler) on 3 ranks, rank 2 killed
    in step 4: the survivors rewind to where step 4 began and split the rest of the epoch
    over themselves; over the completed steps every sample of epoch 0 is used exactly once
    (and of epoch 1's first half none twice), the global batch of 48 kept."""
    block = block_with(DOCS / "recovery.md", "rec = Recovery.adopt(model, opt, global_batch=gb")
    script = RANK_PRELUDE + RECOVERY_PRELUDE + SAMPLER_PRELUDE + block.code + RECOVERY_END
    with Job(tmp_path, script, 3) as job:
        _recovered(job, 15)
    records = [json.loads(line) for r in range(3)
               for line in (tmp_path / f"samples{r}.jsonl").read_text().splitlines()]
    final_world = {step: world for step, world, _ in records}  # a redone step: its last world
    used: dict[int, list[int]] = {}
    for step, world, indices in records:
        if world == final_world[step]:
            used.setdefault(step, []).extend(indices)
    assert sorted(used) == list(range(15))
    assert {final_world[s] for s in range(4)} == {3} and {final_world[s] for s in
                                                          range(4, 15)} == {2}
    assert all(len(used[s]) == 48 for s in used), {s: len(v) for s, v in used.items()}
    epoch0 = [i for s in range(10) for i in used[s]]
    assert sorted(epoch0) == list(range(480))
    epoch1 = [i for s in range(10, 15) for i in used[s]]
    assert len(set(epoch1)) == len(epoch1) == 240


FSDP_PRELUDE = """
import resilient
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from resilient import CheckpointManager, Recovery, ResumableSampler

dist.init_process_group("gloo")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 1)

    def forward(self, inp):
        for layer in self.layers:
            inp = torch.tanh(layer(inp))
        return self.head(inp)


def make_model():
    torch.manual_seed(0)
    return Net()


x = torch.randn(16, FEATURES, generator=torch.Generator().manual_seed(rank))  # this rank's batch
y = x[:, :4].sum(1, keepdim=True)
sampler = ResumableSampler(DistributedSampler(TensorDataset(x), seed=0))


def loss_fn(out, target):
    if rank == 2 and rec.step == KILL_AT:
        die()
    return F.mse_loss(out, target)
"""

FSDP_SETUP = """
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
ckpt = CheckpointManager(os.path.join(OUT, "ckpt"), {"model": model, "optim": opt,
                         "sched": sched}, rank_state={"sampler": sampler}, every=5, create=True)
start, total = ckpt.restore(), STEPS
"""

FSDP_END = """
import hashlib
ckpt.close()
h = hashlib.sha256()
for p in rec.model.parameters():  # DTensors of the survivors' mesh: gathered (collective)
    h.update(p.full_tensor().detach().contiguous().numpy().tobytes())
report(step=rec.step, world=rec.world_size, params=h.hexdigest(), timeline=rec.timeline.events,
       mesh=p.device_mesh.size())
"""


def test_recovery_fsdp2_build_shards_the_model_again_over_the_survivors(tmp_path):
    """The FSDP2 block (build, a model per layer and whole sharded, Recovery.adopt with
    build=) on 3 ranks, with the lines it leaves out (scheduler, CheckpointManager, start)
    after its optimizer; rank 2 killed in step 4: the survivors build the model again over a
    mesh of 2, restore it from the replicas in their memory, redo step 4 and finish with
    identical parameters; the CheckpointManager goes on saving."""
    block = block_with(DOCS / "recovery.md", "rec = Recovery.adopt(model, opt, checkpointer=ckpt")
    opt_line = "opt = torch.optim.AdamW(model.parameters(), lr=3e-3)\n"
    code = substitute(block, (opt_line, opt_line + FSDP_SETUP))
    script = RANK_PRELUDE + RECOVERY_PRELUDE + FSDP_PRELUDE + code + FSDP_END
    with Job(tmp_path, script, 3) as job:
        reports = _recovered(job, 10)
    assert all(r["mesh"] == 2 for r in reports)
    for rep in reports:  # built again, filled from the peers' host memory (not storage)
        kinds = [e["kind"] for e in rep["timeline"]]
        sources = [e["source"] for e in rep["timeline"] if e["kind"] == "restored"]
        assert "model_built" in kinds and sources == ["replica"], rep["timeline"]
    assert (tmp_path / "ckpt" / "step-000000000010").is_dir()  # the manager saved on 2 ranks


# -- docs/straggler.md -----------------------------------------------------------------------
STRAGGLER_PRELUDE = """
import time

SLOW, STEPS = 2, 80
dist.init_process_group("gloo")
excluded = []


class RecoveryLoop:  # the block's policy hook hands the rank to the job's own recovery loop
    def request_exclusion(self, rank, reason):
        excluded.append([rank, reason])


recovery_loop = RecoveryLoop()
torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
loader = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]


def model(batch):
    time.sleep(0.015 if rank == SLOW else 0.005)  # rank 2 computes 3x as long
    return net(batch).square().mean()


def all_reduce_gradients():
    for p in net.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
"""


def test_straggler_monitor_names_the_slowed_rank(tmp_path):
    """The block on 3 ranks (gloo), rank 2's compute 3x the others': every rank prints reports
    naming rank 2 and only rank 2, and calls the policy hook once, for rank 2."""
    block = block_with(DOCS / "straggler.md", "recovery_loop.request_exclusion(rank")
    end = "report(excluded=excluded, persistent=sorted(monitor.persistent_ranks))\n"
    with Job(tmp_path, RANK_PRELUDE + STRAGGLER_PRELUDE + block.code + end, 3) as job:
        codes = job.wait(startup(3) + deadline(30))
        assert codes == [0, 0, 0], job.logs()
    for r in range(3):
        rep = job.report(r)
        assert [rank for rank, _ in rep["excluded"]] == [2], rep
        assert rep["persistent"] == [2], rep
        printed = [line for line in (tmp_path / f"rank{r}.log").read_text().splitlines()
                   if "rank" in line]
        assert printed and all("rank 2" in line for line in printed), printed


EXCLUDE_PRELUDE = """
import time
from torch.nn.parallel import DistributedDataParallel as DDP
from resilient import Recovery, StragglerMonitor
from resilient.recovery import exclude_persistent_straggler

SLOW, STEPS, KILL_AT = 2, 100, -1  # nobody is killed: rank 2 is slow
dist.init_process_group("gloo")
model = DDP(make_model())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
rec = Recovery.adopt(model, opt)  # one batch per rank and step
"""

EXCLUDE_LOOP = """
for step in rec.steps(0, STEPS):
    with rec.attempt():
        xb = inputs(step)[rank * 8:(rank + 1) * 8]
        with monitor.step():
            with monitor.compute():
                time.sleep(0.015 if rank == SLOW else 0.005)  # rank 2 computes 3x as long
                loss = F.mse_loss(rec.model(xb), xb[:, :4].sum(1, keepdim=True))
            with monitor.wait():
                opt.zero_grad()
                loss.backward()  # DDP's gradient all-reduce
            opt.step()
"""


def test_straggler_exclusion_policy_removes_the_rank_through_recovery(tmp_path):
    """The block under Recovery.adopt on 3 ranks, rank 2 computing 3x as long: it is named
    persistent and ends its own process with exit status 76 (EXIT_EVICTED); the survivors'
    recovery removes it and they finish every step on a group of 2."""
    block = block_with(DOCS / "straggler.md", "exclude_persistent_straggler(rec))")
    script = (RANK_PRELUDE + RECOVERY_PRELUDE + EXCLUDE_PRELUDE + block.code + EXCLUDE_LOOP +
              RECOVERY_END)
    # a failure that no verdict explains stops the survivors after 5 s, not 30
    with Job(tmp_path, script, 3, {"RESILIENT_RECOVERY_AGREE_TIMEOUT_S": "5"}) as job:
        codes = job.wait(startup(3) + deadline(40))
    assert codes[2] == 76, job.logs()
    assert "rank 2 is a persistent straggler" in (tmp_path / "rank2.log").read_text()
    assert codes[:2] == [0, 0], job.logs()  # the monitor follows the rebuilt group
    reports = [job.report(r) for r in (0, 1)]
    for rep in reports:
        assert (rep["step"], rep["world"]) == (100, 2), rep["step"]
        agreed = [e for e in rep["timeline"] if e["kind"] == "agreed"]
        assert len(agreed) == 1 and agreed[0]["removed"] == [2], rep["timeline"]
    assert reports[0]["params"] == reports[1]["params"]


# -- docs/training.md ------------------------------------------------------------------------
DDP_PRELUDE = """
import hashlib
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.manual_seed(0)
dist.init_process_group("gloo")
data = torch.randn(400, 16, generator=torch.Generator().manual_seed(1))
dataset = TensorDataset(data, data[:, :4].sum(1, keepdim=True))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Tanh(),
                            torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
total_steps, KILL_AT = 30, int(os.environ.get("KILL_AT", -1))


def train(batch):
    xb, yb = batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(xb), yb).backward()  # dropout: the RNG streams matter
    opt.step()
    sched.step()


def maybe_die(step):
    if step == KILL_AT:  # every rank, once the last periodic save is committed
        ckpt.wait()
        die()
"""

DDP_END = """
ckpt_params = {k: hashlib.sha256(v.detach().numpy().tobytes()).hexdigest()
               for k, v in model.module.state_dict().items()}
report(started=started, params=ckpt_params)
"""


def test_training_quick_start_resumes_bit_exact_after_a_kill(tmp_path):
    """The CheckpointManager quick start (DDP with find_unused_parameters, a loader with its
    own generator) on 2 ranks: killed after step 11 and run again, it resumes from the save of
    step 8 and ends with the parameters of an uninterrupted run, bit for bit."""
    block = block_with(DOCS / "training.md", "model = DDP(model, find_unused_parameters=True)")
    runs = {}
    for name, kill in (("whole", -1), ("killed", 11), ("resumed", -1)):
        root = tmp_path / ("a" if name == "whole" else "b")
        code = substitute(
            block,
            ('"/shared/ckpt"', repr(str(root))),
            ("every=100", "every=4"),
            ("    ...                               # forward, backward, opt.step(), "
             "sched.step()", "    train(batch)"),
            ("    ckpt.step(step)", "    maybe_die(step)\n    ckpt.step(step)"),
            ("step = ckpt.restore()", "step = ckpt.restore()\nstarted = step"),
        )
        with Job(tmp_path / name, RANK_PRELUDE + DDP_PRELUDE + code + DDP_END, 2,
                 {"KILL_AT": str(kill)}) as job:
            codes = job.wait(startup(2) + deadline(30))
            assert codes == ([-signal.SIGKILL] * 2 if kill > 0 else [0, 0]), job.logs()
            if kill < 0:
                runs[name] = job.report(0)
    assert (runs["whole"]["started"], runs["resumed"]["started"]) == (0, 8)
    assert runs["whole"]["params"] == runs["resumed"]["params"]


SHARD_PRELUDE = """
from resilient import CheckpointManager

HIDDEN, DIM = 8, 4
tp = int(os.environ["TP"])
if tp > 1:
    dist.init_process_group("gloo")
tp_rank = rank if tp > 1 else 0
root = os.environ["ROOT"]
g = torch.Generator().manual_seed(0)
fc1, fc2 = torch.randn(HIDDEN, DIM, generator=g), torch.randn(DIM, HIDDEN, generator=g)


class TensorParallel(torch.nn.Module):  # fc1 column-, fc2 row-parallel: this rank's slices
    def __init__(self):
        super().__init__()
        self.fc1_w = torch.nn.Parameter(fc1.chunk(tp, 0)[tp_rank].clone())
        self.fc2_w = torch.nn.Parameter(fc2.chunk(tp, 1)[tp_rank].clone())


model = TensorParallel()
opt = torch.optim.Adam(model.parameters(), lr=0.1)


def state():
    params = dict(model.named_parameters())
    return {**{n: p.tolist() for n, p in params.items()},
            **{n + "/exp_avg": opt.state[p]["exp_avg"].tolist() for n, p in params.items()}}
"""

SHARD_SAVE = """
(model.fc1_w.sum() + model.fc2_w.square().sum()).backward()
opt.step()  # the optimizer's state has the parameters' shapes: it is sliced with them
ckpt.save(1)
ckpt.close()
report(state=state())
"""

SHARD_LOAD = """
for p in model.parameters():
    p.data.zero_()
(model.fc1_w.sum() + model.fc2_w.sum()).backward()
opt.step()  # state to be overwritten
step = ckpt.restore()
ckpt.close()
report(step=step, state=state())
"""


def test_training_shard_specs_save_tp2_slices_and_load_them_on_tp1(tmp_path):
    """The ShardSpec block on 2 tensor-parallel ranks (fc1 split by rows, fc2 by columns),
    then in one process with tp = 1: the full tensors are the slices put together, and so is
    the optimizer state (it inherits the parameters' specs)."""
    import torch

    block = block_with(DOCS / "training.md", "ShardSpec.split((HIDDEN, DIM), dim=0")
    env = {"ROOT": str(tmp_path / "ckpt")}
    with Job(tmp_path / "tp2", RANK_PRELUDE + SHARD_PRELUDE + block.code + SHARD_SAVE, 2,
             {**env, "TP": "2"}) as job:
        assert job.wait(startup(2) + deadline(20)) == [0, 0], job.logs()
        slices = [job.report(r)["state"] for r in (0, 1)]
    with Job(tmp_path / "tp1", RANK_PRELUDE + SHARD_PRELUDE + block.code + SHARD_LOAD, 1,
             {**env, "TP": "1"}) as job:
        assert job.wait(startup(1) + deadline(20)) == [0], job.logs()
        whole = job.report(0)
    assert whole["step"] == 1
    for name in ("fc1_w", "fc1_w/exp_avg"):
        parts = [torch.tensor(s[name]) for s in slices]
        assert torch.equal(torch.tensor(whole["state"][name]), torch.cat(parts, 0)), name
    for name in ("fc2_w", "fc2_w/exp_avg"):
        parts = [torch.tensor(s[name]) for s in slices]
        assert torch.equal(torch.tensor(whole["state"][name]), torch.cat(parts, 1)), name
