"""Recovery.adopt: a torchrun-style script's own default group, store and DDP model.

One process: adopting the group the user created (no "default process group twice"), the store
behind it scoped to the launch attempt, steps run. Four processes: examples/ddp_resilient_run.py
started the way an elastic agent starts workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT, a store hosted
outside the ranks with TORCHELASTIC_USE_AGENT_STORE=True); one rank is SIGKILLed, the others
rebuild (replacing the default group) and end with the failure-free parameters. Every process is
killed with its session at the end, whatever happened.
"""


from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ddp_reference import reference_params

torch = pytest.importorskip("torch")


import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from resilient.recovery import Recovery  # noqa: E402
from resilient.recovery import environment as renv  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


EXAMPLE = ROOT / "examples" / "ddp_resilient_run.py"


STEPS = 16


class FakeDetector:
    def __init__(self, world: int) -> None:
        self.generation = (0, list(range(world)))
        self.store_prefix = "fake"
        self.steps: list[int] = []

    def step(self, n: int) -> None:
        self.steps.append(n)

    def section(self, name: str) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def set_watchdog_option(self, name: str, value: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


@pytest.fixture
def default_group(free_port: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A one-rank default group made as torchrun's workers make it (env://, agent store)."""
    store = dist.TCPStore("127.0.0.1", free_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(renv.LAUNCHER_ENV, raising=False)
    dist.init_process_group("gloo")
    try:
        yield store
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_adopt_takes_the_users_group_store_and_ddp_model(default_group: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    renv._warned.clear()
    model = torch.nn.Linear(4, 1)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="resilient.recovery"):
        rec = Recovery.adopt(ddp, opt, global_batch=4, micro_batch=2,
                             detector=FakeDetector(1))
        rec.start()  # no second init_process_group
        Recovery.adopt(ddp, opt, global_batch=4, micro_batch=2,
                       detector=FakeDetector(1)).start()
    assert rec.module is model and rec.backend == "gloo"
    assert rec._group is dist.group.WORLD and rec.rank == 0 and rec.world_size == 1
    assert isinstance(rec.model, DDP) and rec.model is not ddp
    # The rendezvous store itself (not torch's default_pg prefix), scoped to the attempt.
    rec.store.set("k", "v")
    assert default_group.get("resilient/run/job7.2/k") == b"v"
    # Plain torchrun: said once, with what to use instead.
    said = [r.getMessage() for r in caplog.records if "torchrun" in r.getMessage()]
    assert len(said) == 1 and "resilient run" in said[0], said
    x = torch.randn(4, 4)
    rec.run(lambda step, mb: rec.model(x[mb.slice]).pow(2).mean(), start=0, end=3)
    assert rec.step == 3 and rec.detector.steps == [1, 2, 3]
    # The user's own loop: steps/attempt/micro_batches; the program's own errors propagate.
    for _step in rec.steps(None, 5):
        with rec.attempt():
            opt.zero_grad()
            for mb in rec.micro_batches():
                (rec.model(x[mb.slice]).pow(2).mean() * mb.loss_scale).backward()
            opt.step()
    assert rec.step == 5 and rec.detector.steps[-2:] == [4, 5]
    with pytest.raises(ValueError, match="the user's bug"), rec.attempt():
        raise ValueError("the user's bug")
    assert rec.step == 5
    gates = [h for h in opt._optimizer_step_pre_hooks.values() if getattr(h, "__self__", 0) is rec]
    assert rec._gated and len(gates) == 1  # registered once
    rec.close()
    assert not any(getattr(h, "__self__", 0) is rec for h in opt._optimizer_step_pre_hooks.values())


def test_a_model_on_the_meta_device_is_only_a_sharded_joiners(
        default_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A joiner's first model may hold nothing (resilient.joining()); anywhere else a meta
    model would train nothing, and a DDP joiner's state is copied into its own tensors."""
    import resilient

    with torch.device("meta"):
        model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.delenv(renv.JOIN_ENV, raising=False)
    assert not resilient.joining()
    with pytest.raises(ValueError, match="only a process that joins"):
        Recovery.adopt(model, opt, detector=FakeDetector(1), build=lambda: model).start()
    monkeypatch.setenv(renv.JOIN_ENV, "1")
    assert resilient.joining()
    with pytest.raises(ValueError, match="needs Recovery\\(build=...\\)"):
        Recovery.adopt(model, opt, detector=FakeDetector(1)).start()
    with pytest.raises(ValueError, match="needs Recovery\\(build=...\\)"):
        Recovery.adopt(model, opt, detector=FakeDetector(1)).start(join=True)


def test_adopt_without_a_group_says_what_to_do() -> None:
    assert not dist.is_initialized()
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Recovery.adopt(model, torch.optim.SGD(model.parameters(), lr=0.1), global_batch=2,
                       micro_batch=1)


def test_launcher_warnings() -> None:
    assert renv.launcher({"RESILIENT_LAUNCHER": "resilient", "TORCHELASTIC_RUN_ID": "x"}) == (
        "resilient")
    assert renv.launcher_warnings({"RESILIENT_LAUNCHER": "resilient", "TORCHELASTIC_RUN_ID": "x",
                                   "TORCHELASTIC_USE_AGENT_STORE": "True"}, adopted=True) == []
    (msg,) = renv.launcher_warnings({"TORCHELASTIC_RUN_ID": "x",
                                     "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "SIGTERM" in msg and "resilient run" in msg
    (msg,) = renv.launcher_warnings({"MASTER_ADDR": "h"}, adopted=True)
    assert "rank 0" in msg
    assert renv.launcher_warnings({"MASTER_ADDR": "h"}) == []  # a store the caller passed


def run_ranks(envs: list[dict[str, str]], args: list[str], out: Path,
              timeout: float) -> dict[int, int | None]:
    """Starts one example process per env (its own session), waits up to `timeout`, then
    SIGKILLs whatever is left; returns each one's exit code (None: it had to be killed)."""
    procs = []
    try:
        for i, env in enumerate(envs):
            log = open(out / f"proc{i}.log", "w")  # noqa: SIM115 -- owned by the child
            procs.append(subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--out", str(out), *args], cwd=ROOT,
                env={**os.environ, "PYTHONFAULTHANDLER": "1", **env}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        return {i: p.poll() for i, p in enumerate(procs)}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def check_survivors(out: Path, survivors: list[int], codes: dict[int, int | None],
                    steps: int = STEPS, params: bool = True) -> None:
    """The survivors exited 0 after the last step, in a group of just them, having rebuilt, with
    the failure-free run's parameters (keep_batch; params=False: the same parameters)."""
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(out.glob("*.log")))
    for r in survivors:
        assert codes[r] == 0, (codes, logs)
    reps = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors}
    ref = (reference_params(EXAMPLE, steps) if params
           else torch.tensor(next(iter(reps.values()))["params"]))
    for rep in reps.values():
        assert rep["step"] == steps and rep["world_size"] == len(survivors), rep["step"]
        assert rep["members"] == survivors
        kinds = [e["kind"] for e in rep["timeline"]]
        assert "rebuilt" in kinds and "first_collective" in kinds, kinds
        got = torch.tensor(rep["params"])
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
