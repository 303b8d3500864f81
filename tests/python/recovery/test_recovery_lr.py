"""resilient.recovery.lr: the scale_lr factor on a running schedule. For every kind of torch LR
scheduler, scaling by r mid-run gives r times the unscaled run's learning rates at every later
step (the scheduler neither undoes the factor nor restarts), and a scheduler listed twice is
scaled once."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from resilient.recovery.lr import scale_learning_rates, schedulers_of  # noqa: E402

S = torch.optim.lr_scheduler


def _kinds():
    return {
        "lambda": lambda o: S.LambdaLR(o, lambda s: 0.9 ** s),
        "step": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
        "cosine": lambda o: S.CosineAnnealingLR(o, T_max=20),
        "onecycle": lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=40),
        "cyclic": lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4),
        "plateau": lambda o: S.ReduceLROnPlateau(o, patience=1, factor=0.5),
        "sequential": lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, total_iters=5),
                                                  S.CosineAnnealingLR(o, T_max=20)],
                                               milestones=[5]),
        "chained": lambda o: S.ChainedScheduler([S.ExponentialLR(o, 0.95),
                                                 S.StepLR(o, step_size=4, gamma=0.5)]),
    }


def _run(kind: str, scale_at: int | None, ratio: float, steps: int = 25) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sched = _kinds()[kind](opt)
    lrs = []
    for step in range(steps):
        if step == scale_at:
            scale_learning_rates(opt, [sched, sched], ratio)  # listed twice: scaled once
        opt.step()
        if kind == "plateau":
            sched.step(1.0)  # a flat metric: the rate halves every other step
        else:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("kind", sorted(_kinds()))
@pytest.mark.parametrize("ratio", [0.75, 2 / 3])
def test_a_scaled_schedule_is_the_unscaled_one_times_the_factor(kind: str, ratio: float) -> None:
    ref = _run(kind, None, ratio)
    got = _run(kind, 7, ratio)
    assert got[:7] == ref[:7]
    for step in range(7, len(ref)):
        assert got[step] == pytest.approx(ref[step] * ratio, rel=1e-9), (kind, step)


def test_schedulers_of_finds_nested_ones_of_this_optimizer_only() -> None:
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt, other = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    inner = [S.LinearLR(opt, 0.5, total_iters=2), S.ExponentialLR(opt, 0.9)]
    seq = S.SequentialLR(opt, inner, milestones=[2])
    foreign = S.StepLR(other, 2)
    found = schedulers_of(opt, [seq, foreign, seq, "not a scheduler"])
    assert {id(s) for s in found} == {id(seq), *map(id, inner)}
    scale_learning_rates(opt, [seq, foreign], 0.5)
    assert other.param_groups[0]["lr"] == 0.1 and foreign.base_lrs == [0.1]
