"""``resilient run``: torchrun's arguments, torch's elastic agent and rendezvous, survivors kept.

Pure: how the agent judges its workers' exits. End to end (4 gloo ranks of the ordinary DDP script
examples/ddp_resilient_run.py under ``python -m resilient.run --standalone``): a rank is killed
with SIGKILL from outside mid-run and the job still exits 0 with the failure-free parameters; with
``--replacements 1`` a new process joins the running job in the lost rank's place; a frozen
(SIGSTOP) rank is removed by the survivors and killed by the agent at the end; when recovery
is impossible (``min_world`` 4) the launcher fails the job. Each run is bounded and
killed with its whole session on the way out.
"""


from __future__ import annotations

import time

import pytest

from resilient.recovery.agent import Exit, judge

torch = pytest.importorskip("torch")


def test_judge_keeps_the_group_while_survivors_run() -> None:
    def ex(*pairs: tuple[int, int]) -> list[Exit]:
        return [Exit(r, c) for r, c in pairs]

    assert judge([], 4).state == "healthy"
    assert judge(ex((1, -9)), 3).state == "healthy"  # a lost rank: the others recover
    assert judge(ex((1, -9), (0, 0), (2, 0)), 1).state == "healthy"  # the last one finishing
    assert judge(ex((1, -9), (0, 0), (2, 0), (3, 0)), 0).state == "succeeded"
    assert judge(ex((0, 0), (1, 0)), 0).state == "succeeded"


def test_judge_fails_only_when_recovery_is_impossible() -> None:
    v = judge([Exit(1, -9), Exit(0, 3), Exit(2, 3), Exit(3, 3)], 0)  # survivors stopped
    assert v.state == "failed" and v.reason == "every worker died"
    v = judge([Exit(1, -9), Exit(0, 0), Exit(2, 1)], 1)  # a survivor failed after a finish
    assert v.state == "failed" and "local rank 2 exited with 1" in v.reason


def test_judge_reaps_a_rank_left_running_after_the_others_finished() -> None:
    done = [Exit(0, 0), Exit(1, 0), Exit(3, 0)]  # rank 2 frozen: removed, still a process
    assert judge(done, 1, now=109.0, finished_at=100.0, grace_s=10).state == "healthy"
    v = judge(done, 1, now=110.0, finished_at=100.0, grace_s=10)
    assert v.state == "reap" and "1 worker(s) still running 10s" in v.reason
    assert judge([*done, Exit(2, -9, reaped=True)], 0).state == "succeeded"


def test_judge_gives_a_busy_worker_its_grace_after_its_work() -> None:
    """Rank 0 said it copies to its tiers until t=160 (environment.busy): the 10 s grace counts
    from then for it, from the first clean exit (t=100) for a worker that said nothing."""
    from resilient.recovery.agent import reap_at

    done = [Exit(1, 0), Exit(2, 0)]
    assert reap_at(100.0, 10.0) == 110.0 and reap_at(100.0, 10.0, 160.0) == 170.0
    assert reap_at(100.0, 10.0, 50.0) == 110.0  # work that ended before the others finished
    kw = {"finished_at": 100.0, "grace_s": 10.0}
    assert judge(done, 1, now=150.0, busy_until=[160.0], **kw).state == "healthy"
    assert judge(done, 1, now=170.0, busy_until=[160.0], **kw).state == "reap"
    v = judge(done, 2, now=111.0, busy_until=[160.0], **kw)  # one busy, one frozen
    assert v.state == "reap" and v.reason.startswith("1 worker(s)"), v


def test_the_run_id_names_the_launch() -> None:
    """Under resilient run the run id (and so an etcd store's prefix, Recovery's keys) carries
    the nonce the agents agreed: the same --rdzv-id launched again is another run."""
    from resilient.recovery import environment as renv

    env = {"TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert renv.run_id(env) == "job42.1"  # torchrun
    assert renv.run_id({**env, renv.LAUNCH_ENV: "3f9a1c2b77e0"}) == "job42.1.3f9a1c2b77e0"


def test_parser_is_torchruns_plus_ours() -> None:
    from resilient.cli.run import build_parser

    a = build_parser().parse_args(["--nnodes", "1:2", "--nproc-per-node", "4", "--rdzv-backend",
                                   "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j",
                                   "--max-restarts", "2", "--node-rank", "0", "--replacements",
                                   "1", "train.py", "--lr", "3"])
    assert (a.nnodes, a.nproc_per_node, a.rdzv_endpoint, a.max_restarts) == ("1:2", "4", "h:1", 2)
    assert a.in_process_recovery and a.replacements == 1
    assert a.training_script == "train.py" and a.training_script_args == ["--lr", "3"]
    assert not build_parser().parse_args(["--no-in-process-recovery", "x.py"]).in_process_recovery


@pytest.mark.parametrize("max_world,world,admits", [(0, 4, True), (-1, 4, False),
                                                      (-1, 3, True), (5, 4, True)])
def test_members_admit_joiners_only_up_to_max_world(monkeypatch: pytest.MonkeyPatch,
                                                    max_world: int, world: int,
                                                    admits: bool) -> None:
    import torch.distributed as dist

    from resilient.recovery import RecoveryConfig, join
    from resilient.recovery.timeline import Timeline

    class Rec:
        job, rank, step, admitted, join_epoch, generation = "cap", 1, 8, 0, 0, 0
        initial_world = 4
        timeline = Timeline(1)
        store = dist.HashStore()
        config = RecoveryConfig.from_env(join_check_every=1, max_world=max_world)

    rec = Rec()
    rec.world_size, rec.members = world, list(range(world))
    rec.store.add(join._key(rec, "tickets"), 1)  # a spare waits
    grown: list[list[int]] = []
    monkeypatch.setattr(join, "_regroup", lambda r, gen, rank, members: grown.append(members))
    assert join.maybe_admit(rec) is admits
    assert grown == ([list(range(world)) + [join.JOIN_BASE]] if admits else [])
    # A job that is whole under its cap asks the store nothing at its step boundaries (one
    # add and one compare_set per rank and step, at thousands of ranks, otherwise).
    asked = rec.store.check([join._key(rec, f"admit/{rec.step}")])
    assert asked is not (max_world == -1 and world == 4)


def test_spares_are_refused_without_in_process_recovery() -> None:
    from resilient.cli.run import run

    with pytest.raises(SystemExit):
        run(["--standalone", "--spares", "1", "--no-in-process-recovery", "x.py"])
    with pytest.raises(SystemExit):
        run(["--standalone", "--spares", "-1", "x.py"])
    with pytest.raises(SystemExit):  # a spare finds the job through the agent's TCPStore
        run(["--standalone", "--spares", "1", "--store", "etcd://127.0.0.1:2379", "x.py"])


@pytest.mark.parametrize("device,warm,warmed", [("cpu", True, False), ("cuda", True, True),
                                                 ("cuda", False, False)])
def test_a_joiner_that_comes_too_late_stops_waiting(monkeypatch: pytest.MonkeyPatch,
                                                    device: str, warm: bool,
                                                    warmed: bool) -> None:
    """... and a GPU joiner warms its compute (in the model's dtypes) before its ticket."""
    import torch
    import torch.distributed as dist

    from resilient.recovery import RecoveryConfig, join
    from resilient.recovery.join import join_as_spare, mark_finished
    from resilient.recovery.timeline import Timeline

    calls: list[tuple] = []
    monkeypatch.setattr(join, "warm_compute", lambda dev, dtypes: calls.append(
        (dev.type, dtypes)) or 0.25)

    class Rec:
        job, rank, step = "late", 0, 12
        timeline = Timeline(0)
        store = dist.HashStore()
        config = RecoveryConfig.from_env(warm_spare=warm)
        module = torch.nn.Linear(2, 2, device="meta", dtype=torch.bfloat16)

    member, joiner = Rec(), Rec()
    joiner.step, joiner.device = 0, torch.device(device)
    mark_finished(member)
    t0 = time.monotonic()
    assert join_as_spare(joiner, timeout_s=30) is False
    assert joiner.step == 12 and time.monotonic() - t0 < 5
    kinds = [e["kind"] for e in joiner.timeline.events]
    assert kinds == (["compute_warmed"] if warmed else []) + ["join_requested", "join_too_late"]
    assert calls == ([("cuda", {torch.bfloat16})] if warmed else [])


def test_an_admitted_joiner_takes_the_launch_size_the_members_count() -> None:
    """A joiner started outside `resilient run` (no RESILIENT_JOIN_WORLD) counts its own
    one-rank world; once admitted it takes the members' launch size, or its admission cap and
    batch split would differ from theirs. Its compute warm-up failing does not stop it."""
    import json as _json

    import torch
    import torch.distributed as dist

    from resilient.recovery import RecoveryConfig, join
    from resilient.recovery.timeline import Timeline

    class Rec:
        job, rank, step, initial_world, global_batch, loader_batches = "w", 0, 0, 1, 1, True
        timeline = Timeline(0)
        store = dist.HashStore()
        config = RecoveryConfig.from_env(warm_spare=True)
        module = torch.nn.Linear(2, 2, device="meta")
        device = torch.device("cuda")

    rec = Rec()
    rec.store.set(join._key(rec, "ticket/0"), _json.dumps({
        "group_generation": 1000, "rank": 3, "world_size": 4, "members": [0, 1, 2, 1 << 20],
        "generation": 1, "detector": [1, [0, 1, 2]], "detector_prefix": None,
        "join_epoch": 0, "admitted": 1, "recovery": True, "initial_world": 4}))
    regrouped: list = []

    def no_warm_up(*_a: object) -> float:
        raise RuntimeError("no GPU here")

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(join, "warm_compute", no_warm_up)
        mp.setattr(join, "JoinerDetector", lambda *a, **k: None)
        mp.setattr(join, "_regroup", lambda r, gen, rank, members, recovery=False:
                   regrouped.append((gen, rank, members, recovery)))
        assert join.join_as_spare(rec, timeout_s=10) is True
    finally:
        mp.undo()
    assert (rec.initial_world, rec.global_batch) == (4, 4)
    assert regrouped == [(1000, 3, [0, 1, 2, 1 << 20], True)]
    assert "compute_warmed" not in [e["kind"] for e in rec.timeline.events]
