"""Modules and optimizers are saved by parameter name (checkpoint/views.py): a model saved under
DDP or torch.compile loads into the bare model and back, and optimizer state follows its
parameter by name whatever the parameter order or wrapping of the target."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import resilient
from resilient import IncompatibleCheckpointError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randint(0, 10, (3, 5))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """Each parameter's optimizer state, keyed by the bare model's parameter names."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n])
        for n in a)


def saved_doc(root, step: int) -> str:
    """The manifest of a checkpoint step, as text (it holds the values document)."""
    return (root / f"step-{step:012d}" / "manifest.json").read_text()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_optimizer_state_is_saved_by_parameter_name(tmp_path):
    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
    text = (saved_doc(tmp_path / "c", 1))
    assert "blocks.1.weight" in text and "optim/state/head.weight/exp_avg" in text


def test_a_reordered_fresh_optimizer_gets_each_parameters_own_state(tmp_path):
    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o)
    m2 = Net()
    # other parameter order and another grouping of the same parameters
    params = dict(m2.named_parameters())
    o2 = torch.optim.AdamW([{"params": [params["head.weight"], params["embed.weight"]]},
                            {"params": [p for n, p in reversed(params.items())
                                        if n not in ("head.weight", "embed.weight")]}], lr=0.5)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        with pytest.raises(IncompatibleCheckpointError, match="param_groups"):
            ck.load({"model": m2, "optim": o2})
        assert not o2.state  # nothing changed
        o3 = torch.optim.AdamW(list(reversed(list(m2.parameters()))), lr=0.5)
        assert ck.load({"model": m2, "optim": o3}) == 1
    assert equal(by_name(m, o), by_name(m2, o3))
    assert o3.param_groups[0]["lr"] == 1e-3
    train(m, o)
    train(m2, o3)  # and training goes on identically
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 m2.state_dict().values()))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(perm=st.permutations(range(7)), cut=st.integers(0, 7), trained_target=st.booleans())
def test_any_parameter_order_and_grouping_loads_by_name(tmp_path_factory, perm, cut,
                                                        trained_target):
    root = tmp_path_factory.mktemp("c")
    m = Net()
    named = list(m.named_parameters())
    groups = [[named[i][1] for i in perm[:cut]], [named[i][1] for i in perm[cut:]]]
    o = torch.optim.Adam([{"params": g, "lr": 0.1 * (j + 1)} for j, g in enumerate(groups) if g])
    train(m, o)
    m2 = Net()
    named2 = dict(m2.named_parameters())
    # the target lists each group's parameters in reverse and the groups in reverse
    tgroups = [[named2[named[i][0]] for i in reversed(perm[:cut])],
               [named2[named[i][0]] for i in reversed(perm[cut:])]]
    o2 = torch.optim.Adam([{"params": g, "lr": 9.0} for g in reversed(tgroups) if g])
    if trained_target:
        train(m2, o2, 1)
    with resilient.Checkpointer(root) as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        assert ck.load({"model": m2, "optim": o2}) == 1
    assert equal(by_name(m, o), by_name(m2, o2))
    lr = {id(p): g["lr"] for g in o.param_groups for p in g["params"]}
    names = {id(p): n for n, p in m.named_parameters()}
    lr_by_name = {names[k]: v for k, v in lr.items()}
    names2 = {id(p): n for n, p in m2.named_parameters()}
    for g in o2.param_groups:
        assert {lr_by_name[names2[id(p)]] for p in g["params"]} == {g["lr"]}


def test_ddp_and_compiled_models_load_into_the_bare_model_and_back(tmp_path, one_rank_group):
    torch.manual_seed(0)
    bare = Net()
    ddp = nn.parallel.DistributedDataParallel(bare)
    o = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    train(ddp, o)
    ref = by_name(bare, o)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": ddp, "optim": o}).wait()
        assert "module." not in (saved_doc(tmp_path / "c", 1))
        m2 = Net()
        o2 = torch.optim.AdamW(m2.parameters())
        assert ck.load({"model": m2, "optim": o2}) == 1
        assert equal(ref, by_name(m2, o2))
        assert all(torch.equal(a, b) for a, b in zip(bare.state_dict().values(),
                                                     m2.state_dict().values()))
        # compiled (not run: compiling needs a C compiler) and back into DDP
        compiled = torch.compile(m2)
        assert list(compiled.state_dict())[0].startswith("_orig_mod.")
        ck.save(2, {"model": compiled, "optim": o2}).wait()
        m3 = Net()
        ddp3 = nn.parallel.DistributedDataParallel(m3)
        o3 = torch.optim.AdamW(ddp3.parameters())
        assert ck.load({"model": ddp3, "optim": o3}) == 2
        assert equal(ref, by_name(m3, o3))
        # a DDP state_dict() taken by the user is a plain dict: its keys must match as they are
        with pytest.raises(IncompatibleCheckpointError, match="module object"):
            ck.load({"model": ddp3.state_dict(), "optim": o3})


def test_a_checkpoint_with_ddp_prefixed_keys_still_loads(tmp_path, one_rank_group):
    """Checkpoints written before names were canonical hold DDP's 'module.' keys."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": ddp.state_dict()}).wait()  # a dict: saved as it is
        m2 = Net()
        assert ck.load({"model": m2}) == 1
        ddp2 = nn.parallel.DistributedDataParallel(Net())
        assert ck.load({"model": ddp2}) == 1
    for a, b, c in zip(ddp.module.state_dict().values(), m2.state_dict().values(),
                       ddp2.module.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_an_optimizer_saved_by_name_needs_its_model_to_load(tmp_path):
    m = Net()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train(m, o)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        o2 = torch.optim.SGD(Net().parameters(), lr=0.5, momentum=0.9)
        with pytest.raises(IncompatibleCheckpointError, match="load the model and its optimizer"):
            ck.load({"optim": o2})
        assert not o2.state and o2.param_groups[0]["lr"] == 0.5


def test_a_parameter_missing_from_the_target_is_named(tmp_path):
    m = Net()
    o = torch.optim.AdamW(m.parameters())
    train(m, o)
    m2 = Net()
    o2 = torch.optim.AdamW([p for n, p in m2.named_parameters() if n != "head.weight"])
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        with pytest.raises(IncompatibleCheckpointError,
                           match="only in the checkpoint: head.weight"):
            ck.load({"model": m2, "optim": o2})
    assert not o2.state


def test_an_optimizer_saved_alone_stays_positional(tmp_path):
    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"optim": o}).wait()
        assert "optim/state/0/exp_avg" in (saved_doc(tmp_path / "c", 1))
        m2 = Net()
        o2 = torch.optim.AdamW(m2.parameters())
        assert ck.load({"model": m2, "optim": o2}, strict=False) == 1
    assert equal(by_name(m, o), by_name(m2, o2))


def test_a_submodule_named_module_is_not_a_wrapper(tmp_path):
    outer = nn.Module()
    outer.module = Net()
    o = torch.optim.AdamW(outer.parameters())
    train(outer.module, o)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": outer, "optim": o}).wait()
        assert "module.head.weight" in (saved_doc(tmp_path / "c", 1))
        outer2 = nn.Module()
        outer2.module = Net()
        o2 = torch.optim.AdamW(outer2.parameters())
        assert ck.load({"model": outer2, "optim": o2}) == 1
    assert equal(by_name(outer, o), by_name(outer2, o2))


@pytest.mark.parametrize("target_trained", [False, True])
def test_by_name_state_loads_into_a_state_dict_taken_by_hand(tmp_path, target_trained):
    """The DCP idiom with plain state dicts: load into o.state_dict(), then o.load_state_dict();
    the by-name optimizer state is renumbered group by group, as load_state_dict pairs it."""
    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o)
    m2 = Net()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    if target_trained:
        train(m2, o2, 1)  # its state dict holds state under positional ids
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        sd = {"model": m2.state_dict(), "optim": o2.state_dict()}
        assert ck.load(sd) == 1
        o2.load_state_dict(sd["optim"])
        bad = torch.optim.AdamW([{"params": list(m2.parameters())[:2]},
                                 {"params": list(m2.parameters())[2:]}])
        with pytest.raises(IncompatibleCheckpointError, match="param_groups hold"):
            ck.load({"model": m2.state_dict(), "optim": bad.state_dict()})
    assert equal(by_name(m, o), by_name(m2, o2))
    assert o2.param_groups[0]["lr"] == 1e-3


def test_torchtitan_style_wrappers_with_flattened_optimizer_state(tmp_path):
    """torchtitan's checkpointing idiom: Stateful wrappers around get_model_state_dict and
    get_optimizer_state_dict(flatten_optimizer_state_dict=True), the optimizer's state
    initialised before the load."""
    from idioms import torchtitan_wrappers

    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o)
    m2 = Net()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    for p in m2.parameters():
        p.grad = torch.zeros_like(p)
    o2.step()  # as torchtitan's OptimizersContainer initialises its state
    o2.zero_grad()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        model, optim = torchtitan_wrappers(m, o)
        ck.save(1, {"model": model, "optimizer": optim}).wait()
        model2, optim2 = torchtitan_wrappers(m2, o2)
        assert ck.load({"model": model2, "optimizer": optim2}) == 1
    assert equal(by_name(m, o), by_name(m2, o2))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 m2.state_dict().values()))


def test_optimizer_state_inherits_its_parameters_spec_and_positional_specs_raise(tmp_path):
    from resilient.checkpoint import ShardSpec

    m = Net()
    o = torch.optim.AdamW(m.parameters())
    train(m, o)
    whole = ShardSpec.split((2, 4), 0, 0, 1)  # head.weight, one part of one
    with resilient.Checkpointer(tmp_path / "a", specs={"model/head.weight": whole}) as ck:
        assert ck.spec_for("optim/state/head.weight/exp_avg", (2, 4), None) is whole
        assert ck.spec_for("optim/state/head.weight/step", (), None) is None  # other shape
        assert ck.spec_for("optim/state/blocks.0.weight/exp_avg", (4, 4), None) is None
        ck.save(1, {"model": m, "optim": o}).wait()
    other = ShardSpec.split((4, 4), 0, 1, 2)  # two specs name head.weight, and differ
    half = ShardSpec.split((4, 4), 0, 0, 2)
    with resilient.Checkpointer(tmp_path / "c", specs={"model/head.weight": half,
                                                       "ema/head.weight": other}) as ck:
        with pytest.raises(ValueError, match="differ"):
            ck.spec_for("optim/state/head.weight/exp_avg", (2, 4), None)
    with resilient.Checkpointer(tmp_path / "b", specs={"optim/state/6/*": whole}) as ck:
        with pytest.raises(ValueError, match="keyed by parameter name"):
            ck.save(1, {"model": m, "optim": o})
        ck.save(1, {"optim": o}).wait()  # saved alone: positional, the spec applies


def test_an_optimizer_with_its_own_state_dict_layout_is_saved_as_it_is(tmp_path):
    class Custom(torch.optim.SGD):
        def state_dict(self):
            sd = super().state_dict()
            return {"inner": sd, "extra": 7}

        def load_state_dict(self, sd):
            assert sd["extra"] == 7
            super().load_state_dict(sd["inner"])

    m = Net()
    o = Custom(m.parameters(), lr=0.1, momentum=0.9)
    train(m, o)
    m2 = Net()
    o2 = Custom(m2.parameters(), lr=0.5, momentum=0.9)
    train(m2, o2, 1)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        assert "optim/inner/state/0/momentum_buffer" in saved_doc(tmp_path / "c", 1)
        assert ck.load({"model": m2, "optim": o2}) == 1
    assert equal(by_name(m, o), by_name(m2, o2))


def test_a_save_reads_the_parameters_themselves_yet_builds_no_graph_and_changes_nothing(tmp_path):
    """A save takes a module's parameters as they are (state_dict(keep_vars=True), no detach
    per tensor); they keep requires_grad and their values, and the saved bytes are theirs. A
    module with a state_dict() of its own (no keep_vars argument) is saved through it."""

    class OwnStateDict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))

        def state_dict(self):  # noqa: D102 (an override without nn.Module's arguments)
            return {"w2": self.w.detach() * 2}

        def load_state_dict(self, sd, strict=True):
            with torch.no_grad():
                self.w.copy_(sd["w2"] / 2)

    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, o)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    own = OwnStateDict()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        for mode in ("blocking", "overlap"):
            h = ck.save(1 if mode == "blocking" else 2, {"model": m, "own": own}, mode=mode)
            h.wait()
        assert all(p.requires_grad and p.grad is None for p in m.parameters())
        for step in (1, 2):
            fresh, own2 = Net(), OwnStateDict()
            with torch.no_grad():
                own2.w.zero_()
            ck.load({"model": fresh, "own": own2}, step=step)
            assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
            assert torch.equal(own2.w, own.w)
