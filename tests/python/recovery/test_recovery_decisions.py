"""Recovery's decisions, as pure functions of (now, state): an injected clock, no sleeps."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from resilient import ResilientError
from resilient.recovery import PeerFailure, RecoveryStopped
from resilient.recovery.decisions import agree, classify, member_failed, poll_collective


def test_poll_keeps_polling_until_a_reason_to_stop():
    assert poll_collective(10.0, 20.0, evicted=False, member_failed=False) is None
    assert poll_collective(20.5, 20.0, evicted=False, member_failed=False) == "timeout"
    assert poll_collective(10.0, 20.0, evicted=False, member_failed=True) == "verdict"
    # eviction wins over everything: this rank must stop, not recover
    assert poll_collective(30.0, 20.0, evicted=True, member_failed=True) == "evicted"


@given(now=st.floats(0, 1e6), budget=st.floats(0, 1e3))
def test_poll_times_out_exactly_after_the_deadline(now, budget):
    start = 1000.0
    decision = poll_collective(start + now, start + budget, evicted=False, member_failed=False)
    assert (decision == "timeout") == (start + now > start + budget)


def test_an_old_generation_is_not_a_new_failure():
    watched = {0, 1, 2, 3}
    assert not member_failed(4, [0, 1, 2, 3], min_generation=0, watched=watched)
    assert member_failed(4, [0, 2, 3], min_generation=4, watched=watched)
    assert not member_failed(4, [0, 2, 3], min_generation=5, watched=watched)  # handled


def test_agreement_waits_then_agrees_or_times_out():
    kw = dict(min_generation=3, watched={0, 1, 2})
    clock = [100.0]
    deadline = clock[0] + 30
    assert agree(clock[0], deadline, 2, [0, 1, 2], evicted=False, **kw).action == "wait"
    clock[0] += 29.9
    assert agree(clock[0], deadline, 2, [0, 1, 2], evicted=False, **kw).action == "wait"
    a = agree(clock[0], deadline, 3, [0, 2], evicted=False, **kw)
    assert (a.action, a.generation, a.removed, a.live) == ("agreed", 3, [1], [0, 2])
    clock[0] += 0.2
    assert agree(clock[0], deadline, 2, [0, 1, 2], evicted=False, **kw).action == "timeout"
    assert agree(clock[0], deadline, 2, [0, 1, 2], evicted=True, **kw).action == "evicted"


def _raise_from_torch_distributed() -> RuntimeError:
    """A RuntimeError as gloo raises it: from inside torch.distributed's code."""
    try:
        dist.broadcast(None, src=0)  # no process group: raises from distributed_c10d
    except (RuntimeError, ValueError) as e:
        return e if isinstance(e, RuntimeError) else RuntimeError(str(e)).with_traceback(
            e.__traceback__)
    raise AssertionError("expected an error")


def test_failures_are_classified_by_type_and_origin_not_by_message():
    assert classify(PeerFailure("timeout")) == "timeout"
    assert classify(ValueError("x"), pending="verdict") == "verdict"
    assert classify(dist.DistBackendError("NCCL error")) == "collective_error"
    assert classify(dist.DistNetworkError("x")) == "collective_error"
    # a user's error that merely mentions gloo or NCCL is not a peer failure
    assert classify(RuntimeError("my gloo-themed model failed: connection reset")) is None
    assert classify(KeyError("nccl")) is None
    assert classify(_raise_from_torch_distributed()) == "collective_error"
    # a functional collective's wait (DTensor redistribute, full_tensor) raises below it, from
    # the op dispatcher: still a collective error; the dispatcher alone is not
    assert classify(_raise_below("_functional_collectives.py")) == "collective_error"
    assert classify(_raise_below("_tensor_ops_only.py")) is None
    # another op on an AsyncCollectiveTensor (an OOM, a shape error) is the program's error
    assert classify(_raise_below("_functional_collectives.py", "__torch_dispatch__")) is None


def _raise_below(name: str, caller: str = "wait_tensor") -> RuntimeError:
    """A RuntimeError raised by code in torch/_ops.py called from function `caller` of
    torch/distributed/<name>."""
    sep = os.sep
    scope: dict = {}
    exec(compile("def op():\n    raise RuntimeError('Connection reset by peer')\n",
                 f"{sep}x{sep}torch{sep}_ops.py", "exec"), scope)
    exec(compile(f"def {caller}(op):\n    op()\n",
                 f"{sep}x{sep}torch{sep}distributed{sep}{name}", "exec"), scope)
    try:
        scope[caller](scope["op"])
    except RuntimeError as e:
        return e
    raise AssertionError("expected an error")


def test_recovery_errors_are_resilient_errors():
    assert issubclass(PeerFailure, ResilientError)
    assert issubclass(RecoveryStopped, ResilientError)
    with pytest.raises(RuntimeError):  # still RuntimeErrors for code that caught those
        raise RecoveryStopped("too few ranks")


def test_a_device_is_lost_only_when_its_error_is_the_devices_and_the_device_fails(monkeypatch):
    from resilient.recovery import device as device_state

    cpu = torch.device("cpu")
    cuda_error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    # the device still works: the program's own error (or a peer's), nothing to leave for
    assert device_state.lost(cuda_error, cpu, collective_error=False) is None
    calls = []

    def broken(dev: torch.device) -> None:
        calls.append(dev)
        err = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        err.error_code = 700
        raise err

    monkeypatch.setattr(device_state, "probe", broken)
    why = device_state.lost(cuda_error, cpu, collective_error=False)
    assert why == "AcceleratorError 700: CUDA error: an illegal memory access was encountered"
    # raised from one (a wrapper's error): found through the chain
    try:
        try:
            raise cuda_error
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert device_state.lost(outer, cpu, collective_error=False) is not None
    # a collective's error (NCCL reports CUDA failures as one) is probed too ...
    assert device_state.lost(dist.DistBackendError("NCCL"), cpu, collective_error=True)
    # ... but not the program's other errors, whatever they say: no probe at all
    calls.clear()
    assert device_state.lost(RuntimeError("CUDA error"), cpu, collective_error=False) is None
    assert calls == []


def test_the_agent_restarts_a_rank_whose_device_was_lost_from_max_restarts() -> None:
    from resilient.recovery.agent import ResilientAgent
    from resilient.recovery.device import EXIT_DEVICE_LOST

    agent = ResilientAgent.__new__(ResilientAgent)  # the budget logic only
    agent.replacements_left, agent._remaining_restarts = 0, 1
    assert agent._restart_budget(-9) is None  # a lost rank without --replacements: not replaced
    assert agent._restart_budget(1) is None
    assert agent._restart_budget(EXIT_DEVICE_LOST) == "restarts"
    agent._remaining_restarts = 0
    assert agent._restart_budget(EXIT_DEVICE_LOST) is None
    agent.replacements_left = 1  # --replacements pays first, for any lost rank
    assert agent._restart_budget(-9) == "replacements"
    assert agent._restart_budget(EXIT_DEVICE_LOST) == "replacements"


def test_hsdp_all_reduce_is_polled_for_the_newest_recovery_until_it_closes() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    from resilient.recovery import sharded

    assert fc.dist is dist
    first, second = object(), object()
    try:
        sharded._poll_hsdp_all_reduce(first)
        assert fc.dist.rec is first and fc.dist.ReduceOp is dist.ReduceOp  # the rest is torch's
        sharded._poll_hsdp_all_reduce(second)  # a rebuilt or newer Recovery takes it over
        assert fc.dist.rec is second
        sharded.unpoll_hsdp_all_reduce(first)  # an older one closing leaves it alone
        assert fc.dist.rec is second
        sharded.unpoll_hsdp_all_reduce(second)
        assert fc.dist is dist
    finally:
        fc.dist = dist


def test_abort_groups_aborts_every_group_whatever_one_raises() -> None:
    from resilient.comm.process_group import abort_groups, nccl_groups

    aborted = []

    class Group:
        def __init__(self, name: str, error: type[Exception] | None = None) -> None:
            self.name, self.error = name, error

        def abort(self) -> None:
            aborted.append(self.name)
            if self.error:
                raise self.error("no abort here")

    assert abort_groups([Group("a"), Group("b", RuntimeError), Group("c", NotImplementedError)])
    assert sorted(aborted) == ["a", "b", "c"]

    import threading

    release = threading.Event()

    class Stuck:
        def abort(self) -> None:
            release.wait(10)

    assert not abort_groups([Group("d"), Stuck()], timeout_s=0.1)  # bounded: not waited for
    release.set()
    assert nccl_groups() == []  # no process group here


def test_the_default_group_is_replaced_while_its_nccl_abort_still_runs(monkeypatch) -> None:
    """An NCCL abort can take 0.5 s (its proxy threads' poll): the group leaves torch's registry
    at once, unshut (a shutdown would wait for the abort's lock), and a new default group forms
    while the abort finishes on its own thread."""
    import threading

    from resilient.comm import process_group as pgm
    from resilient.ports import free_port

    release, started, done = threading.Event(), threading.Event(), []

    shut: list[str] = []

    class SlowAbort:  # an NCCL group whose abort waits for its proxy thread
        def abort(self) -> None:
            started.set()
            release.wait(10)

        def shutdown(self) -> None:  # torch's shutdown would wait for the abort's lock
            shut.append("slow")

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    world, slow = dist.group.WORLD, SlowAbort()
    dist.distributed_c10d._world.pg_names[slow] = "slow"  # registered as a mesh's group is
    monkeypatch.setattr(pgm, "nccl_groups", lambda: [world, slow])
    try:
        pgm.abort_process_group(revoke=True, background=True)  # gloo: nothing to revoke
        assert started.wait(5) and not dist.is_initialized()
        assert shut == [] and slow not in dist.distributed_c10d._world.pg_names
        dist.init_process_group("gloo", store=dist.PrefixStore("g1", store), rank=0,
                                world_size=1)
        x = torch.ones(1)
        dist.all_reduce(x)  # the new group works while the old abort still runs
        assert x.item() == 1.0
        assert pgm.start_aborts([slow], on_done=done.append) == 0  # already under way: skipped
        assert not pgm.wait_for_aborts(0.05)  # bounded: still running
        release.set()
        assert pgm.wait_for_aborts(5)
        assert done == []  # the skipped call started no thread of its own
    finally:
        release.set()
        if dist.is_initialized():
            dist.destroy_process_group()
        pgm.release_retired_groups()


def test_start_aborts_reports_when_the_last_abort_ended() -> None:
    from resilient.comm.process_group import revoke_groups, start_aborts, wait_for_aborts

    class Group:
        def __init__(self, error: type[Exception] | None = None) -> None:
            self.error = error

        def abort(self) -> None:
            if self.error:
                raise self.error("no abort here")

    done: list[float] = []
    assert start_aborts([Group(), Group(RuntimeError)], on_done=done.append) == 0
    assert wait_for_aborts(5) and len(done) == 1 and done[0] >= 0
    assert revoke_groups([Group()]) == 0  # no NCCL communicator: nothing revoked, no error


def test_revoke_is_used_only_with_the_nccl_torch_itself_uses(monkeypatch, tmp_path) -> None:
    """A communicator handed to another copy of NCCL would corrupt memory: resilient's library
    must resolve ncclCommRevoke to the same address as torch's."""
    import shutil
    from pathlib import Path

    from resilient.comm import native
    from resilient.comm import process_group as pgm

    torch_dir = native.torch_nccl_dir()
    if torch_dir is None or torch.version.cuda is None:
        pytest.skip("this torch brings no NCCL of its own")
    lib = pgm._find_torch_nccl()
    assert lib is not None and lib.supports("revoke")
    assert tuple(int(x) for x in lib.version_string.split(".")) == torch.cuda.nccl.version()
    # the same version from another file is another copy of NCCL: refused
    copy = tmp_path / "libnccl.so.2"
    shutil.copyfile(Path(torch_dir) / "libnccl.so.2", copy)
    load = native.load_nccl
    monkeypatch.setattr(native, "load_nccl", lambda: load(str(copy), search_system=False))
    other = pgm._find_torch_nccl()
    assert other is None


class _FakeNcclGroup:
    """A group whose backend is itself, with communicator ``ptr`` (tests replace
    ``dist.ProcessGroupNCCL`` with it, so revoke_groups takes it for an NCCL group)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def _get_backend(self, _device: object) -> _FakeNcclGroup:
        return self

    def _comm_ptr(self) -> int:
        return self.ptr


def test_an_abort_waits_for_a_revoke_of_its_group_still_running(monkeypatch) -> None:
    """ncclCommRevoke can return 0.5 s after it freed the training thread, which meanwhile
    starts the rebuild's abort: that abort (which frees the communicator) must wait for the
    revoke, on its own thread, not on the training thread; a group whose abort began is never
    revoked."""
    import threading

    from resilient.comm import process_group as pgm

    events: list[str] = []
    revoking, release = threading.Event(), threading.Event()

    class Lib:
        def revoke_comm(self, ptr: int) -> None:
            events.append(f"revoke {ptr}")
            revoking.set()
            release.wait(10)
            events.append("revoke returned")

    class Group(_FakeNcclGroup):
        def abort(self) -> None:
            events.append(f"abort {self.ptr}")

    monkeypatch.setattr(pgm, "_torch_nccl", lambda: Lib())
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Group)  # revoke_groups revokes NCCL groups
    first, second = Group(1), Group(2)
    detector = threading.Thread(target=pgm.revoke_groups, args=([first],))
    detector.start()
    assert revoking.wait(5)
    assert pgm.start_aborts([first, second]) == 0  # returns at once
    assert not pgm.wait_for_aborts(0.2)  # the first group's abort waits for its revoke
    assert events == ["revoke 1", "abort 2"]  # the other group's abort did not wait
    assert pgm.revoke_groups([first, second]) == 0  # revoked, or its abort began
    release.set()
    detector.join(5)
    assert pgm.wait_for_aborts(5)
    assert events == ["revoke 1", "abort 2", "revoke returned", "abort 1"]
    pgm.release_retired_groups()


def test_each_group_is_revoked_on_a_thread_of_its_own(monkeypatch) -> None:
    """HSDP on 4 H200s: a revoke waited for the device while the next group's kernel, stuck on
    the dead peer, ran on; revoked one after the other, the second never was. Here the first
    revoke returns only once the second was issued."""
    import threading

    from resilient.comm import process_group as pgm

    second_issued = threading.Event()
    returned: list[int] = []

    class Lib:
        def revoke_comm(self, ptr: int) -> None:
            if ptr == 1:
                assert second_issued.wait(10), "the second group was not revoked meanwhile"
            else:
                second_issued.set()
            returned.append(ptr)

    Group = _FakeNcclGroup

    class Gloo:  # not NCCL: nothing to revoke
        def _get_backend(self, _device: object) -> Gloo:
            return self

    monkeypatch.setattr(pgm, "_torch_nccl", lambda: Lib())
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Group)
    groups = [Group(1), Group(2), Group(0), Gloo()]  # 0: no communicator (never used)
    assert pgm.revoke_groups(groups) == 2
    assert pgm.wait_for_revoke(groups[0], 5) and pgm.wait_for_revoke(groups[1], 5)
    assert sorted(returned) == [1, 2]
    pgm.release_retired_groups()


def test_a_backend_is_found_inside_the_detail_debug_wrapper() -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps each backend in a checking wrapper; the NCCL
    groups (aborted and revoked after a lost rank) must still be found as NCCL groups."""
    from resilient.comm.process_group import backend_of
    from resilient.ports import free_port

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        raw = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert isinstance(raw, dist.distributed_c10d._ProcessGroupWrapper)
        assert isinstance(backend_of(dist.group.WORLD, torch.device("cpu")), dist.ProcessGroupGloo)
        assert backend_of(object(), torch.device("cpu")) is None
    finally:
        dist.set_debug_level(level)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["revoke", "no_revoke_in_nccl", "setting_off"])
def test_a_verdict_during_an_nccl_step_revokes_or_aborts(monkeypatch, mode: str) -> None:
    """The detector's thread on a verdict: revoke (the abort follows in the background, at the
    rebuild or shortly after), abort in the background where NCCL cannot revoke, or abort and
    wait with RESILIENT_RECOVERY_REVOKE_NCCL=0."""
    import threading
    import time

    from resilient.comm import process_group as pgm
    from resilient.recovery import Recovery, RecoveryConfig, core
    from resilient.recovery.timeline import Timeline

    calls: list[str] = []
    aborted = threading.Event()

    class Lib:
        def revoke_comm(self, ptr: int) -> None:
            calls.append(f"revoke {ptr}")

    class Group:
        def _get_backend(self, _device: object) -> Group:
            return self

        def _comm_ptr(self) -> int:
            return 7

        def abort(self) -> None:
            calls.append("abort")
            aborted.set()

    group = Group()
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Group)
    monkeypatch.setattr(pgm, "with_nccl_groups", lambda g: [g])
    monkeypatch.setattr(pgm, "_torch_nccl", lambda: None if mode == "no_revoke_in_nccl" else Lib())
    monkeypatch.setattr(core, "_ABORT_AFTER_REVOKE_S", 0.2)
    rec = Recovery.__new__(Recovery)
    rec._group, rec.generation, rec.timeline = group, 1, Timeline(0)
    rec._device = torch.device("cpu")
    rec.config = RecoveryConfig(revoke_nccl=mode != "setting_off")
    rec._abort_in_flight()
    kinds = [e["kind"] for e in rec.timeline.events]
    if mode == "revoke":
        assert calls == ["revoke 7"] and "revoked" in kinds  # no abort yet: it would hold
        time.sleep(0.05)                                      # the lock FSDP2's next
        assert calls == ["revoke 7"]                          # collective waits for
        assert aborted.wait(5)  # the fallback: nobody else began it
    elif mode == "no_revoke_in_nccl":
        assert aborted.wait(5) and calls == ["abort"]
    else:
        assert calls == ["abort"]  # waited for
    assert pgm.wait_for_aborts(5)
    pgm.release_retired_groups()


@pytest.mark.parametrize(("sending", "failed", "expected"),
                         [(False, False, 5.0), (True, False, 30.0), (True, True, 0.0)])
def test_a_recovery_the_script_did_not_close_is_closed_at_exit(monkeypatch, sending: bool,
                                                              failed: bool,
                                                              expected: float) -> None:
    """The replication threads must end before the interpreter finalizes: briefly for the
    buddies' stop messages, longer while a snapshot is sent, not at all after an uncaught
    exception; the checkpointer's own exit handler waits for its saves."""
    import sys

    from resilient.recovery import Recovery, RecoveryConfig
    from resilient.recovery.timeline import Timeline

    waited: list[float] = []

    class Replicas:
        def __init__(self) -> None:
            self.sending = sending

        def close(self, timeout_s: float) -> None:
            waited.append(timeout_s)

    class Checkpointer:
        def wait(self, _timeout: float) -> None:
            waited.append(-1.0)

    if failed:
        monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    else:
        monkeypatch.delattr(sys, "last_value", raising=False)
    rec = Recovery.__new__(Recovery)
    rec.started, rec.replicas, rec.build, rec._gated, rec.detector = True, Replicas(), None, \
        False, None
    rec.checkpointer, rec.config, rec.timeline = Checkpointer(), RecoveryConfig(), Timeline(0)
    rec._close_at_exit()
    assert waited == [expected] and not rec.started
    rec._close_at_exit()  # once only
    assert waited == [expected]


def test_retired_groups_are_released_once_their_own_timeout_passed() -> None:
    """Recovery releases, at every step boundary, the groups retired by past recoveries whose
    collective timeout has passed (their stuck collectives returned), so nothing grows by one
    group per recovery; a group still within its timeout stays referenced (its destructor
    would wait for the stuck collective)."""
    import datetime
    import gc
    import time
    import types
    import weakref

    from resilient.comm import process_group as pgm

    class Backend:
        def __init__(self, seconds: float) -> None:
            self.options = types.SimpleNamespace(_timeout=datetime.timedelta(seconds=seconds))

    class Group:
        def __init__(self, seconds: float) -> None:
            self.backend = Backend(seconds)

        def _get_backend(self, device: torch.device) -> Backend:
            if device.type != "cpu":
                raise RuntimeError("no backend for cuda")
            return self.backend

    pgm.release_retired_groups()
    expired, waiting = Group(0.0), Group(3600.0)
    gone, kept = weakref.ref(expired), weakref.ref(waiting)
    pgm.retire_groups([expired, waiting])
    del expired, waiting
    assert pgm.release_retired_groups(expired_only=True) == 1
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:  # dropped on a thread of its own
        gc.collect()
        time.sleep(0.01)
    assert gone() is None and kept() is not None
    assert pgm.release_retired_groups(expired_only=True) == 0
    assert pgm.release_retired_groups() == 1
