"""Recovery's decisions in one process with fake collectives and a fake detector: how a polled
collective ends (done, error, verdict, timeout, eviction), what counts as a peer failure, and
agreement that never comes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from resilient.comm.process_group import wait_for_aborts  # noqa: E402
from resilient.recovery import PeerFailure, Recovery, RecoveryConfig, RecoveryStopped  # noqa: E402


class FakeDetector:
    def __init__(self, world: int) -> None:
        self.gen = (0, list(range(world)))
        self.steps: list[int] = []

    @property
    def generation(self) -> tuple:
        return self.gen

    def step(self, n: int) -> None:
        self.steps.append(n)

    def stop(self) -> None:
        pass


class FakeWork:
    def __init__(self, done_after_s: float | None, error: str = "") -> None:
        self.t_done = None if done_after_s is None else time.monotonic() + done_after_s
        self.error = error

    def is_completed(self) -> bool:
        return self.t_done is not None and time.monotonic() >= self.t_done

    def wait(self) -> None:
        if self.error:
            raise RuntimeError(self.error)


def make(world: int = 4, **cfg: Any) -> Recovery:
    model = torch.nn.Linear(2, 1)
    rec = Recovery(None, 0, world, model, torch.optim.SGD(model.parameters(), lr=0.1),
                   global_batch=8, micro_batch=2,
                   config=RecoveryConfig.from_env(**cfg), detector=FakeDetector(world))
    return rec


def test_poll_returns_when_the_collective_completes() -> None:
    rec = make()
    rec._wait_work(FakeWork(0.01))
    assert rec._pending_cause is None


def test_poll_turns_a_backend_error_into_a_collective_error() -> None:
    rec = make()
    with pytest.raises(PeerFailure, match="collective_error.*Connection closed"):
        rec._wait_work(FakeWork(0.0, "[gloo] Connection closed by peer"))
    assert rec._failure_cause(RuntimeError("wrapped by DDP")) == "collective_error"
    assert rec._pending_cause is None  # consumed


def test_poll_stops_on_a_verdict_without_waiting_for_the_collective() -> None:
    rec = make()
    det = rec.detector

    def verdict() -> None:
        time.sleep(0.05)
        det.gen = (1, [0, 2, 3])
        rec._on_failure([1], 1)

    threading.Thread(target=verdict).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="verdict"):
        rec._wait_work(FakeWork(None))  # never completes (a frozen peer)
    assert time.monotonic() - t0 < 5
    assert rec._failure_cause(RuntimeError("x")) == "verdict"


def test_verdict_about_ranks_already_removed_is_ignored() -> None:
    rec = make()
    rec.members = [0, 2, 3]
    rec.detector.gen = (1, [0, 2, 3])
    rec._min_generation = 2
    rec._on_failure([1], 1)
    rec._wait_work(FakeWork(0.01))  # completes: the verdict concerns no current member


def test_poll_times_out() -> None:
    rec = make(collective_timeout_s=0.05)
    with pytest.raises(PeerFailure, match="timeout"):
        rec._wait_work(FakeWork(None))


def test_eviction_stops_the_rank(caplog: pytest.LogCaptureFixture) -> None:
    """The detector's eviction callback says why and leaves at once with EXIT_EVICTED (76),
    whatever the training thread is doing; the training thread's own paths stop too."""
    from resilient.recovery import EXIT_EVICTED

    rec = make()
    left: list[int] = []
    rec.leave = left.append  # os._exit in a real rank
    with caplog.at_level("ERROR", logger="resilient.recovery"):
        rec._on_evicted(3)
    assert left == [EXIT_EVICTED] and EXIT_EVICTED == 76
    said = caplog.records[-1].getMessage()
    assert said.startswith("[rank0]: resilient: this rank was removed from the job") and (
        "generation 3" in said and "exiting with 76" in said), said
    with pytest.raises(PeerFailure, match="evicted"):
        rec._wait_work(FakeWork(None))
    with pytest.raises(RecoveryStopped, match="removed from the job"):
        rec._recover(rec._failure_cause(RuntimeError("x")), RuntimeError("x"))
    assert left == [EXIT_EVICTED]  # once


def test_the_exit_codes_are_distinct() -> None:
    from resilient.recovery import EXIT_EVICTED, STRAGGLER_EXIT_CODE
    from resilient.recovery.agent import EXIT_WORKER_KILLED
    from resilient.recovery.device import EXIT_DEVICE_LOST

    assert STRAGGLER_EXIT_CODE == EXIT_EVICTED  # a straggler removes itself: a removal
    codes = [EXIT_EVICTED, EXIT_DEVICE_LOST, RecoveryStopped.exit_code, EXIT_WORKER_KILLED, 1]
    assert len(set(codes)) == len(codes), codes


def test_unrelated_errors_are_not_failures() -> None:
    rec = make()
    assert rec._failure_cause(ValueError("shape mismatch in my model")) is None
    assert rec._failure_cause(PeerFailure("timeout")) == "timeout"


def test_collective_error_without_a_verdict_stops_after_the_agree_timeout() -> None:
    rec = make(agree_timeout_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(RecoveryStopped, match="detector removed no rank within 0.1s"):
        rec._recover("collective_error", RuntimeError("connection reset"))
    assert time.monotonic() - t0 < 5
    assert [e["kind"] for e in rec.timeline.events] == ["failure_observed", "stopped"]


def test_too_small_world_stops_before_any_rebuild() -> None:
    rec = make(min_world=4)
    rec.detector.gen = (1, [0, 1, 2])
    with pytest.raises(RecoveryStopped, match="only 3 of 4 ranks remain"):
        rec._recover("verdict", PeerFailure("verdict"))
    kinds = [e["kind"] for e in rec.timeline.events]
    assert kinds == ["failure_observed", "agreed", "stopped"]


def test_max_recoveries() -> None:
    rec = make(max_recoveries=1)
    rec.recoveries = 1
    with pytest.raises(RecoveryStopped, match="more than 1 recoveries"):
        rec._recover("verdict", PeerFailure("verdict"))


@pytest.mark.parametrize("policy", ["none", "scale_lr", "keep_batch"])
def test_a_world_change_keeps_the_schedulers_learning_rate(policy: str) -> None:
    """The policy's factor multiplies the rates as the schedule left them (a recovery used to
    reset them to the rates at construction), and a scheduler does not undo it at its next
    step."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    rec = Recovery(None, 0, 4, model, opt, global_batch=32, micro_batch=8,
                   config=RecoveryConfig(policy=policy), extra_state={"sched": sched})
    for _ in range(3):
        opt.step()
        sched.step()
    factor = 0.75 if policy == "scale_lr" else 1.0
    rec.apply_world(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3 * factor)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4 * factor)
    rec.apply_world(4)  # a joiner brought the world back
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    assert rec.lr_factor == 1.0


def test_without_a_global_batch_a_step_is_one_loader_batch_per_rank() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recovery(None, 0, 4, model, opt, config=RecoveryConfig(policy="keep_batch"))
    assert rec.config.policy == "none" and rec.plan.global_batch == 4
    rec.apply_world(3)
    assert rec.plan.global_batch == 3 and rec.plan.micro_batches(0)[0].loss_scale == 1.0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="both global_batch and micro_batch"):
        Recovery(None, 0, 4, model, opt, global_batch=32)


class FakeGroup:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def gpu_like(rec: Recovery, work: FakeWork) -> FakeGroup:
    """The NCCL path without a GPU: the optimizer gate's CUDA event is ``work``."""
    rec.backend, rec._device = "nccl", torch.device("cuda", 0)
    rec._device_fence = lambda: work.is_completed  # type: ignore[method-assign]
    rec._group = FakeGroup()
    rec._gate_optimizer()
    rec._in_step = True
    return rec._group


def test_the_optimizer_gate_waits_for_the_all_reduce_then_lets_the_step_run() -> None:
    rec = make()
    gpu_like(rec, FakeWork(0.05))
    before = rec.module.weight.detach().clone()
    rec.module.weight.grad = torch.ones_like(before)
    t0 = time.monotonic()
    rec.optimizer.step()
    assert time.monotonic() - t0 >= 0.04 and rec._applied
    assert not torch.equal(rec.module.weight, before)
    assert [e["kind"] for e in rec.timeline.events] == []  # not awaiting a first collective


def test_a_verdict_while_the_gate_waits_fails_the_step_before_the_update() -> None:
    rec = make()
    group = gpu_like(rec, FakeWork(None))  # the all-reduce waits for a dead peer
    before = rec.module.weight.detach().clone()
    rec.module.weight.grad = torch.ones_like(before)

    def verdict() -> None:
        time.sleep(0.05)
        rec.detector.gen = (1, [0, 2, 3])
        rec._on_failure([1], 1)

    detector = threading.Thread(target=verdict)
    detector.start()
    with pytest.raises(PeerFailure, match="verdict"):
        rec.optimizer.step()
    assert torch.equal(rec.module.weight, before) and not rec._applied
    # from the detector's thread, on a thread of its own (no revoke for this fake group): a
    # CUDA sync in the step returns
    detector.join(30)
    assert wait_for_aborts(5)
    assert group.aborted == 1
    assert rec._failure_cause(RuntimeError("x")) == "verdict"


def test_a_fence_completed_by_the_abort_does_not_let_the_step_run() -> None:
    """The abort ends the hung kernel, so the event completes: the verdict still fails it."""
    rec = make()
    gpu_like(rec, FakeWork(0.0))
    rec.detector.gen = (1, [0, 2, 3])
    rec._on_failure([1], 1)
    rec.module.weight.grad = torch.ones_like(rec.module.weight)
    before = rec.module.weight.detach().clone()
    with pytest.raises(PeerFailure, match="verdict"):
        rec.optimizer.step()
    assert torch.equal(rec.module.weight, before)


def test_no_abort_outside_a_step_or_for_a_verdict_about_others() -> None:
    rec = make()
    group = gpu_like(rec, FakeWork(0.0))
    rec._in_step = False
    rec._on_failure([1], 1)
    rec._in_step = True
    rec._on_failure([7], 1)  # not a member (a joiner the detector does not watch)
    assert wait_for_aborts(5)
    assert group.aborted == 0


def test_an_optimizer_without_step_hooks_is_refused_on_nccl() -> None:
    rec = make()
    rec.backend, rec.optimizer = "nccl", object()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        rec._gate_optimizer()


@pytest.mark.parametrize("fail_after_update", [False, True])
def test_attempt_redoes_only_a_step_whose_update_did_not_run(fail_after_update: bool) -> None:
    """A failure before optimizer.step: the step is redone. After it (a collective of the
    user's own, for logging): the step counts and is not applied twice."""
    rec = make()
    recovered: list[BaseException] = []
    rec._recover_until_done = recovered.append  # type: ignore[method-assign]
    rec.module.weight.grad = torch.ones_like(rec.module.weight)
    with rec.attempt():
        if fail_after_update:
            rec.optimizer.step()
        raise PeerFailure("collective_error", "[gloo] Connection closed by peer")
    assert len(recovered) == 1 and not rec._in_step
    assert rec.step == (1 if fail_after_update else 0)
    assert rec.detector.steps == ([1] if fail_after_update else [])
    with rec.attempt():
        rec.optimizer.step()
    assert rec.step == (2 if fail_after_update else 1)


def test_every_optimizer_of_the_state_is_gated() -> None:
    """A second optimizer (in extra_state) must not update from a half-reduced gradient."""
    model = torch.nn.Linear(2, 1)
    head = torch.nn.Linear(2, 1)
    second = torch.optim.SGD(head.parameters(), lr=0.1)
    rec = Recovery(None, 0, 4, model, torch.optim.SGD(model.parameters(), lr=0.1),
                   global_batch=8, micro_batch=2, extra_state={"head_opt": second},
                   detector=FakeDetector(4))
    gpu_like(rec, FakeWork(0.0))
    rec.detector.gen = (1, [0, 2, 3])
    rec._on_failure([1], 1)
    head.weight.grad = torch.ones_like(head.weight)
    before = head.weight.detach().clone()
    with pytest.raises(PeerFailure, match="verdict"):
        second.step()
    assert torch.equal(head.weight, before)
    rec.close()
    second.step()  # the gate went with the Recovery
    assert not torch.equal(head.weight, before)


def test_a_verdict_during_a_step_whose_update_never_ran_redoes_the_step() -> None:
    """NCCL: GradScaler skipped the update on the aborted group's gradients (or no optimizer
    stepped): the step must not count."""
    rec = make()
    gpu_like(rec, FakeWork(0.0))
    recovered: list[BaseException] = []
    rec._recover_until_done = recovered.append  # type: ignore[method-assign]
    with rec.attempt():
        rec.detector.gen = (1, [0, 2, 3])
        rec._on_failure([1], 1)
    assert len(recovered) == 1 and rec.step == 0 and rec.detector.steps == []


def test_a_failed_step_leaves_no_grad_scaler_half_done() -> None:
    from torch.amp.grad_scaler import GradScaler, OptState

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    rec = Recovery(None, 0, 4, model, opt, global_batch=8, micro_batch=2,
                   extra_state={"scaler": scaler}, detector=FakeDetector(4))
    rec._recover_until_done = lambda exc: None  # type: ignore[method-assign]
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with rec.attempt():
        scaler.unscale_(opt)  # as before clip_grad_norm_
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
        raise PeerFailure("collective_error", "peer gone")
    scaler.unscale_(opt)  # the redo: no "unscale_() has already been called"


def test_the_gate_holds_every_step_not_only_the_first() -> None:
    """Each step's update waits for that step's all-reduce (the run path: one flag per step)."""
    rec = make()
    work = FakeWork(0.0)
    gpu_like(rec, work)
    rec.module.weight.grad = torch.ones_like(rec.module.weight)
    rec._begin_step()
    rec.optimizer.step()
    assert rec._applied
    rec._end_step()
    rec._begin_step()  # the next step: its all-reduce waits for a dead peer
    assert not rec._applied
    work.t_done = None
    rec.detector.gen = (1, [0, 2, 3])
    rec._on_failure([1], 1)
    before = rec.module.weight.detach().clone()
    with pytest.raises(PeerFailure, match="verdict"):
        rec.optimizer.step()
    assert torch.equal(rec.module.weight, before)


def test_samplers_are_split_over_the_data_parallel_ranks_the_job_names() -> None:
    """Tensor parallelism: a pair of ranks reads the same batches, so the samplers are split
    over ``data_parallel(world, rank)``, not over the group (4 ranks in pairs: 2 readers;
    FSDP2 over the 3 left: 3)."""
    from torch.utils.data import DistributedSampler

    from resilient import ResumableSampler

    pairs = lambda world, rank: (world // 2, rank // 2) if world == 4 else (world, rank)  # noqa: E731
    sampler = ResumableSampler(DistributedSampler(list(range(48)), num_replicas=2, rank=1,
                                                  shuffle=False))
    model = torch.nn.Linear(2, 1)
    rec = Recovery(None, 3, 4, model, torch.optim.SGD(model.parameters(), lr=0.1),
                   samplers=[sampler], data_parallel=pairs, detector=FakeDetector(4))
    it = iter(sampler)
    assert [next(it) for _ in range(4)] == [1, 3, 5, 7]  # 8 of the epoch consumed in all
    rec.samplers.begin(rec.step)
    rec.apply_world(4)  # the same pairs: this rank is reader 1 of 2 again
    assert (sampler.distributed.num_replicas, sampler.distributed.rank) == (2, 1)
    assert list(sampler)[:3] == [9, 11, 13]
    rec.world_size, rec.rank = 3, 2  # FSDP2 over the 3 left: every rank reads
    rec.apply_world(3)
    assert (sampler.distributed.num_replicas, sampler.distributed.rank) == (3, 2)
    assert list(sampler)[:3] == [10, 13, 16]


def test_a_sampler_split_otherwise_than_data_parallel_says_is_refused() -> None:
    """Without ``data_parallel``, a sampler split over tensor-parallel pairs would be re-split
    over every rank at the first world change: refused at construction, with what to pass."""
    from torch.utils.data import DistributedSampler

    from resilient import ResumableSampler

    sampler = ResumableSampler(DistributedSampler(list(range(48)), num_replicas=2, rank=1))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"split over 2 ranks .*data_parallel\(4, 3\) gives "
                                         r"\(4, 3\): pass Recovery\(data_parallel="):
        Recovery(None, 3, 4, model, torch.optim.SGD(model.parameters(), lr=0.1),
                 samplers=[sampler], detector=FakeDetector(4))


@pytest.mark.parametrize("error,peer", [("root", False), ("collective", True)])
def test_a_restore_error_that_is_not_a_peers_is_raised_as_it_is(error: str, peer: bool) -> None:
    """Moving the checkpointer onto the new group fails: a peer's failure (CollectiveError)
    starts the next recovery; the program's own (the root held by another writer) is raised at
    once, not turned into a wait for a verdict no peer's loss will bring (30 s, then 'the
    detector removed no rank')."""
    from resilient.errors import CollectiveError, RootInUseError

    rec = make()
    rec.detector.gen = (1, [0, 2, 3])
    rec._rebuild = lambda gen, survivors: None  # type: ignore[method-assign]

    def follow_group(lost_rank: bool) -> None:
        if error == "root":
            raise RootInUseError("/ckpt is being written by another process (pid 7)")
        raise CollectiveError("checkpoint collective abandoned: generation 2 removed rank(s) [2]")

    rec.follow_group = follow_group  # type: ignore[method-assign]
    with pytest.raises(PeerFailure if peer else RootInUseError):
        rec._recover("verdict", RuntimeError("x"))
