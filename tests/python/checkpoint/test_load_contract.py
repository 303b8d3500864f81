"""The load contract (docs/STATE.md), one process: each case of the load-contract issue as a
regression test. Multi-rank cases: test_load_contract_dist.py; generated states:
test_load_contract_props.py."""


from __future__ import annotations

import collections
import errno
import json
import os
import re
import time

import numpy as np
import pytest
import torch
from torch import nn

import resilient
from resilient import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from resilient.checkpoint.manager import CheckpointManager


def trained(seed: int = 0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    s = torch.optim.lr_scheduler.StepLR(o, 2, 0.5)
    for _ in range(3):
        m(torch.randn(5, 4)).pow(2).sum().backward()
        o.step()
        s.step()
    return m, o, s


def fresh(seed: int = 1):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters(), lr=0.5)
    s = torch.optim.lr_scheduler.StepLR(o, 2, 0.5)
    return m, o, s


def same(a, b) -> bool:
    """Bit-exact equality of nested state (tensors by bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_restored(m, o, s, m2, o2, s2):
    assert same(m.state_dict(), m2.state_dict())
    assert same(o.state_dict(), o2.state_dict())
    assert s.state_dict() == s2.state_dict()
    assert o2.param_groups[0]["lr"] == o.param_groups[0]["lr"]


# 1. objects and state dicts are interchangeable, all four ways -------------------------------
@pytest.mark.parametrize("save_as", ["objects", "state_dicts"])
def test_saved_state_dicts_load_into_objects_and_back(tmp_path, save_as):
    m, o, s = trained()
    state = ({"model": m, "optim": o, "sched": s} if save_as == "objects" else
             {"model": m.state_dict(), "optim": o.state_dict(), "sched": s.state_dict()})
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(7, state).wait()
        m2, o2, s2 = fresh()
        assert ck.load({"model": m2, "optim": o2, "sched": s2}) == 7
        assert_restored(m, o, s, m2, o2, s2)
        # The DCP idiom: load into state dicts, then load_state_dict() them.
        m3, o3, s3 = fresh(2)
        sd = {"model": m3.state_dict(), "optim": o3.state_dict(), "sched": s3.state_dict()}
        assert ck.load(sd) == 7
        assert same(m3.state_dict(), m.state_dict())  # module tensors land in place
        o3.load_state_dict(sd["optim"])
        s3.load_state_dict(sd["sched"])
        assert_restored(m, o, s, m3, o3, s3)


def test_get_state_dict_and_stateful_app_state_idioms(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m, o, _ = trained()
    msd, osd = get_state_dict(m, o)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": msd, "optim": osd}).wait()
        m2, o2, _ = fresh()
        msd2, osd2 = get_state_dict(m2, o2)  # initialises the optimizer's state
        assert ck.load({"model": msd2, "optim": osd2}) == 1
        set_state_dict(m2, o2, model_state_dict=msd2, optim_state_dict=osd2)
        assert same(m.state_dict(), m2.state_dict())
        assert same(o.state_dict(), o2.state_dict())

        class AppState:  # the DCP Stateful app-state idiom
            def __init__(self, model, optim):
                self.model, self.optim = model, optim

            def state_dict(self):
                msd, osd = get_state_dict(self.model, self.optim)
                return {"model": msd, "optim": osd}

            def load_state_dict(self, sd):
                set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                               optim_state_dict=sd["optim"])

        ck.save(2, {"app": AppState(m, o)}).wait()
        m3, o3, _ = fresh(3)
        assert ck.load({"app": AppState(m3, o3)}) == 2
        assert same(m.state_dict(), m3.state_dict()) and same(o.state_dict(), o3.state_dict())


# 2. targets the engine cannot write raise, naming the tensor ---------------------------------
def test_meta_targets_raise_and_nothing_changes(tmp_path):
    m, o, _ = trained()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m}).wait()
        with torch.device("meta"):
            meta = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        with pytest.raises(IncompatibleCheckpointError, match="'model/0.weight'.*meta device"):
            ck.load({"model": meta})
        with pytest.raises(TypeError, match="meta"):
            ck.save(2, {"model": meta})


# 3. the manager reads live objects at every save ---------------------------------------------
def test_manager_refuses_state_dicts_captured_once(tmp_path):
    m, o, s = trained()
    with pytest.raises(TypeError, match=r"\['optim'\]\['param_groups'\]\[0\]\['lr'\].*captured|"
                       r"state_dict\(\) taken once"):
        CheckpointManager(tmp_path / "c", {"model": m.state_dict(), "optim": o.state_dict()})
    with pytest.raises(TypeError, match="sched"):
        CheckpointManager(tmp_path / "c", {"model": m, "sched": s.state_dict()})


def test_manager_saves_the_state_as_of_each_save(tmp_path):
    m, o, s = trained()
    mgr = CheckpointManager(tmp_path / "c", lambda: {"model": m, "optim": o, "sched": s},
                            every=1, create=True, rng=False)
    assert mgr.restore() == 0
    mgr.save(1).wait()
    m(torch.randn(5, 4)).sum().backward()
    o.step()
    s.step()
    mgr.save(2).wait()
    mgr.close()
    m2, o2, s2 = fresh()
    mgr2 = CheckpointManager(tmp_path / "c", {"model": m2, "optim": o2, "sched": s2}, rng=False)
    assert mgr2.restore() == 2
    assert_restored(m, o, s, m2, o2, s2)
    assert o2.state_dict()["state"][0]["step"].item() == 4  # not the empty state of step 0
    mgr2.close()


# 5. strict by default: every difference named, nothing modified -------------------------------
def test_renamed_missing_and_unexpected_keys_raise_with_target_unchanged(tmp_path):
    m, o, _ = trained()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m, "optim": o}).wait()
        m2, o2, _ = fresh()
        before = {k: v.clone() for k, v in m2.state_dict().items()}
        with pytest.raises(IncompatibleCheckpointError) as info:
            ck.load({"net": m2, "optim": o2})
        assert info.value.missing == ["net"] and info.value.unexpected == ["model"]
        assert same(before, m2.state_dict()) and o2.state_dict()["state"] == {}
        with pytest.raises(IncompatibleCheckpointError, match="sched"):
            ck.load({"model": m2, "optim": o2, "sched": torch.optim.lr_scheduler.StepLR(o2, 1)})
        assert same(before, m2.state_dict())
        # strict=False restores what matches and reports the rest
        assert ck.load({"net": m2, "optim": o2}, strict=False) == 1
        assert ck.last_load.missing == ["net"] and ck.last_load.unexpected == ["model"]
        assert same(o.state_dict(), o2.state_dict())


def test_kind_dtype_shape_and_length_changes_are_mismatches(tmp_path):
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"t": torch.ones(3), "f": 0.5, "l": [1, 2, 3], "x": torch.ones(2, 2)}).wait()
        cases = [
            ({"t": 1.0}, "'t'"),                    # a tensor saved, a float wanted
            ({"f": torch.zeros(1)}, "'f'"),         # a float saved, a tensor wanted
            ({"l": [0, 0]}, "'l': the checkpoint has 3 items"),
            ({"x": torch.zeros(2, 2, dtype=torch.float64)}, "'x': checkpoint has float32"),
            ({"x": torch.zeros(4)}, r"'x': checkpoint has float32\[2, 2\]"),
        ]
        for bad, why in cases:
            target = {"t": torch.zeros(3), "f": 0.0, "l": [0, 0, 0], "x": torch.zeros(2, 2)}
            target.update(bad)
            snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in target.items()}
            with pytest.raises(IncompatibleCheckpointError, match=why):
                ck.load(target)
            assert same(snapshot, target)


def test_a_module_wrapped_differently_names_the_keys(tmp_path):
    m, _, _ = trained()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"model": m}).wait()
        wrapped = nn.Module()
        wrapped.module = fresh()[0]
        with pytest.raises(IncompatibleCheckpointError, match="model/module.0.weight"):
            ck.load({"model": wrapped})


# 6. "no checkpoint yet" only for a root resilient initialised ---------------------------------
def test_roots_that_are_not_checkpoint_roots_raise(tmp_path):
    m, _, _ = trained()
    root = tmp_path / "run"
    with resilient.Checkpointer(root) as ck:
        ck.save(3, {"model": m}).wait()
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resilient.Checkpointer(tmp_path / "rnu").load({"model": m})
    assert not (tmp_path / "rnu").exists()  # opening never creates
    with pytest.raises(CheckpointNotFoundError, match="one step of a resilient checkpoint.*step=3"):
        resilient.Checkpointer(root / "step-000000000003").load({"model": m})
    dcp_dir = tmp_path / "dcp"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": m.state_dict()}, checkpoint_id=str(dcp_dir), no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match="DCP"):
        resilient.Checkpointer(dcp_dir).load({"model": m})
    (tmp_path / "ts").mkdir()
    torch.save(m.state_dict(), tmp_path / "ts" / "model.pt")
    with pytest.raises(CheckpointNotFoundError, match="torch.save"):
        resilient.Checkpointer(tmp_path / "ts").load({"model": m})
    with pytest.raises(CheckpointNotFoundError, match="refusing"):
        resilient.Checkpointer(tmp_path / "ts", create=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="did not initialise"):
        resilient.Checkpointer(tmp_path / "empty").load({})
    with pytest.raises(CheckpointNotFoundError, match="step 9"):
        resilient.Checkpointer(root).load({"model": m}, step=9)
    # create=True: a fresh run
    with resilient.Checkpointer(tmp_path / "new", create=True) as ck:
        assert ck.load({"model": m}) is None
    assert (tmp_path / "new" / "resilient-root.json").exists()
    with resilient.Checkpointer(tmp_path / "new") as ck:  # initialised: no step yet is fine
        assert ck.load({"model": m}) is None


def test_processes_creating_one_root_at_once_all_succeed(tmp_path, monkeypatch):
    """Ranks that each open the same new root with create=True (distributed=False, as a
    per-rank loop does) all succeed: a marker another process is still writing makes the
    directory a root, whenever it appears between looks (it failed CI once: one rank listed
    the directory empty, another's temporary marker appeared, and the first refused it)."""
    from concurrent.futures import ThreadPoolExecutor

    from resilient.checkpoint import root as roots

    real = roots._names
    looks: list[str] = []

    def another_process_writes_its_marker_meanwhile(path):
        names = real(path)
        if os.path.isdir(path) and not looks:
            looks.append(path)
            (tmp_path / "raced" / "resilient-root.json.tmp.0123abcd").write_text("{}")
        return names

    (tmp_path / "raced").mkdir()
    monkeypatch.setattr(roots, "_names", another_process_writes_its_marker_meanwhile)
    roots.ensure_root(str(tmp_path / "raced"))
    assert (tmp_path / "raced" / "resilient-root.json").exists()
    monkeypatch.setattr(roots, "_names", real)
    for i in range(20):  # and for real: threads racing to create one root
        where = str(tmp_path / f"root{i}")
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(roots.ensure_root, [where] * 8))
        assert roots.is_root(where)


# 7. lineage: a rollback starts a new branch ---------------------------------------------------
def test_rollback_starts_a_branch_and_retention_keeps_its_lineage(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=3) as ck:
        for s in (10, 20, 30):
            ck.save(s, {"w": torch.full((4,), float(s))}).wait()
        state = {"w": torch.zeros(4)}
        assert ck.load(state, step=10) == 10  # a loss spike: back to 10
        ck.save(11, {"w": torch.full((4,), 11.0)}).wait()
        ck.save(12, {"w": torch.full((4,), 12.0)}).wait()
        ck.wait()
        assert ck.steps() == [10, 11, 12] and ck.lineage() == [12, 11, 10]
    with resilient.Checkpointer(root, keep=3) as ck:  # after a crash: the new branch
        assert ck.load(state) == 12 and torch.equal(state["w"], torch.full((4,), 12.0))
        ck.save(20, {"w": torch.full((4,), 20.5)}).wait()  # a step number used on the old branch
        ck.wait()  # and the retention after it
        assert ck.lineage() == [20, 12, 11]
    assert (root / "latest").read_text() == "step-000000000020\n"


def test_a_branch_survives_while_its_first_save_is_pending(tmp_path):
    """Until the first save of a new branch commits, the old head stays the head (a crash
    right after load(step=k) resumes where the run was, not at k)."""
    with resilient.Checkpointer(tmp_path / "c", keep=0) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((2,), float(s))}).wait()
        ck.load({"w": torch.zeros(2)}, step=1)
        assert ck.lineage() == [3, 2, 1]
        ck.save(4, {"w": torch.zeros(2)}).wait()
        ck.wait()  # and the retention after it
        assert ck.lineage() == [4, 1] and ck.steps() == [1, 4]


# 9. errors come at the next call; waits are interruptible -------------------------------------
def test_a_failed_save_is_raised_by_the_next_save(tmp_path, small_tmpfs):
    with resilient.Checkpointer(small_tmpfs, keep=5) as ck:
        ck.save(1, {"w": torch.ones(1 << 20)}).wait()
        ck.save(2, {"w": torch.full((4 << 20,), 2.0)})  # 16 MiB: does not fit, not waited for
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ck._in_flight[-1].done():
            time.sleep(0.05)
        with pytest.raises(resilient.checkpoint.CheckpointCommitError, match="step 2.*No space"):
            ck.save(3, {"w": torch.ones(1 << 20)})
        ck.save(3, {"w": torch.ones(1 << 20)}).wait()  # raised once; the space came back
        assert ck.steps() == [1, 3]


# 10. plain types out; order and named tuples survive ------------------------------------------
def test_loading_into_an_empty_dict_gives_plain_types(tmp_path):
    m, o, s = trained()
    Point = collections.namedtuple("Point", ["x", "y"])
    state = {"model": m, "optim": o, "sched": s, "b": {"z": 1, "a": 2},
             "od": collections.OrderedDict([("q", 1), ("b", 2)]), "pt": Point(1, torch.ones(2)),
             "arr": np.arange(3)}
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, state).wait()
        out: dict = {}
        assert ck.load(out) == 1
    assert isinstance(out["model"], collections.OrderedDict)
    assert same(dict(out["model"]), dict(m.state_dict()))
    assert list(out["b"]) == ["z", "a"] and isinstance(out["od"], collections.OrderedDict)
    assert list(out["od"]) == ["q", "b"]
    assert out["pt"][0] == 1 and type(out["pt"]) is tuple  # a plain type: torch.save takes it
    assert isinstance(out["arr"], np.ndarray)
    out.pop("arr")  # numpy arrays are not among torch.load(weights_only)'s types
    torch.save(out, tmp_path / "plain.pt")  # plain types: torch.save(weights_only) takes them
    torch.load(tmp_path / "plain.pt", weights_only=True)
    o2 = torch.optim.AdamW(fresh()[0].parameters())
    o2.load_state_dict(out["optim"])  # a usable optimizer state dict
    assert o2.param_groups[0]["lr"] == o.param_groups[0]["lr"]


def test_a_named_tuple_target_keeps_its_type(tmp_path):
    Point = collections.namedtuple("Point", ["x", "y"])
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"p": Point(3, torch.ones(2))}).wait()
        target = {"p": Point(0, torch.zeros(2))}
        ck.load(target)
    assert isinstance(target["p"], Point) and target["p"].x == 3


def test_manifest_values_say_which_format(tmp_path):
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
    doc = json.loads((tmp_path / "c" / "step-000000000001" / "manifest.json").read_text())
    assert doc["values"]["format"] == "resilient.sharded/1" and doc["world_size"] == 1
    body, digest = (tmp_path / "c" / "step-000000000001" / "lineage.json").read_text().split()
    doc = json.loads(body)
    assert re.fullmatch(r"[0-9a-f]{16}", doc.pop("id"))  # tells two roots' commits apart
    assert doc == {"seq": 1, "step": 1, "parent": None}
    assert digest == resilient._C.xxh3_hex(body.encode())


def test_an_edited_manifest_fails_its_seal_and_falls_back(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=5) as ck:
        ck.save(1, {"lr": 0.001, "w": torch.ones(2)}).wait()
        ck.save(2, {"lr": 0.001, "w": torch.full((2,), 2.0)}).wait()
    manifest = root / "step-000000000002" / "manifest.json"
    manifest.write_text(manifest.read_text().replace("0.001", "0.003"))  # one digit
    with resilient.Checkpointer(root) as ck:
        state = {"lr": 0.0, "w": torch.zeros(2)}
        assert ck.load(state) == 1 and state["lr"] == 0.001
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            ck.load(state, step=2)


def test_every_bit_flip_of_a_manifest_is_caught(tmp_path):
    """A bounded sweep (every bit of the first and last 300 bytes, every 11th bit between):
    no flip loads different state. benchmarks/RESULTS.md records the full sweep.

    One Checkpointer serves the whole sweep (a new one per flip started two threads each, about
    5,000 times): every load reads and parses the manifest anew, and the same object loads the
    undamaged manifest after the sweep, so a failed load left nothing behind that fails the next.
    """
    root = tmp_path / "c"
    saved = {"model": {"w": torch.arange(4.0)}, "lr": 0.001, "step": 1}
    with resilient.Checkpointer(root, keep=5) as ck:
        ck.save(1, saved).wait()
    manifest = root / "step-000000000001" / "manifest.json"
    good = manifest.read_bytes()
    n = len(good) * 8
    bits = [b for b in range(n) if b < 2400 or b >= n - 2400 or b % 11 == 0]
    with resilient.Checkpointer(root) as ck:
        for bit in bits:
            bad = bytearray(good)
            bad[bit // 8] ^= 1 << (bit % 8)
            manifest.write_bytes(bytes(bad))
            state = {"model": {"w": torch.zeros(4)}, "lr": 0.0, "step": 0}
            try:
                ck.load(state, step=1)
            except (CorruptCheckpointError, IncompatibleCheckpointError, OSError):
                continue
            raise AssertionError(f"bit {bit} flipped and the load succeeded: {state}")
        manifest.write_bytes(good)
        state = {"model": {"w": torch.zeros(4)}, "lr": 0.0, "step": 0}
        assert ck.load(state, step=1) == 1
        assert torch.equal(state["model"]["w"], saved["model"]["w"])
        assert (state["lr"], state["step"]) == (saved["lr"], saved["step"])


def test_a_malformed_values_document_is_corrupt_and_falls_back(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=5) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
        ck.save(2, {"w": torch.full((2,), 2.0)}).wait()
    manifest = root / "step-000000000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["values"]["ranks"][0]["state"] = {"w": {"$tensor": "renamed"}}
    manifest.write_text(resilient._C.seal_manifest(json.dumps(doc)))  # a consistent, wrong doc
    with resilient.Checkpointer(root) as ck:
        state = {"w": torch.zeros(2)}
        assert ck.load(state) == 1 and ck.last_load.skipped[0][0] == 2
        with pytest.raises(CorruptCheckpointError, match="renamed"):
            ck.load(state, step=2)


def test_steps_cover_the_int64_range(tmp_path):
    """A millisecond timestamp as the step: saved, listed, loaded and retained like any other."""
    big = [10**12 - 1, 1_763_900_000_000, 2**63 - 1]
    with resilient.Checkpointer(tmp_path / "c", keep=2) as ck:
        for s in big:
            ck.save(s, {"w": torch.full((2,), float(s % 1000))}).wait()
        ck.wait()
        assert ck.steps() == big[1:] and ck.lineage() == big[:0:-1]
        state = {"w": torch.zeros(2)}
        assert ck.load(state) == 2**63 - 1
        with pytest.raises(ValueError, match="step must be"):
            ck.save(-1, {"w": torch.zeros(2)})


def test_a_passing_io_error_is_raised_not_skipped(tmp_path):
    """EIO is no proof of corruption: skipping the step would branch the next save off its
    parent and retention would delete it."""
    import errno

    from resilient import _C

    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=3) as ck:
        for s in (100, 200, 300):
            ck.save(s, {"w": torch.full((4,), float(s))}).wait()
    _C.install_fault_hook(["open"], errno.EIO, path_contains="step-000000000300/rank-0", count=1)
    try:
        with resilient.Checkpointer(root, keep=3) as ck:
            state = {"w": torch.zeros(4)}
            with pytest.raises(OSError) as info:
                ck.load(state)
            assert info.value.errno == errno.EIO
            assert ck.load(state) == 300 and state["w"][0] == 300  # the fault has passed
    finally:
        _C.clear_fault_hook()


def test_a_module_whose_state_dict_copies_still_gets_loaded(tmp_path):
    class Copying(nn.Linear):  # like FSDP1's full state dict: state_dict() hands out clones
        def state_dict(self, *args, **kwargs):
            return {k: v.clone() for k, v in super().state_dict(*args, **kwargs).items()}

    torch.manual_seed(0)
    src = Copying(2, 2)
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"m": src}).wait()
        dst = Copying(2, 2)
        with torch.no_grad():
            dst.weight.zero_()
        assert ck.load({"m": dst}) == 1
    assert torch.equal(dst.weight, src.weight)


def test_a_top_level_tuple_target_is_refused(tmp_path):
    with resilient.Checkpointer(tmp_path / "c") as ck:
        ck.save(1, (torch.ones(2), 7)).wait()
        target = (torch.zeros(2), 0)
        with pytest.raises(IncompatibleCheckpointError, match="tuple cannot be restored"):
            ck.load(target)
        assert torch.equal(target[0], torch.zeros(2))


def test_a_damaged_lineage_record_deletes_nothing(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=0) as ck:
        for s in (100, 200, 300):
            ck.save(s, {"w": torch.full((2,), float(s))}).wait()
    record = root / "step-000000000100" / "lineage.json"
    record.write_text(record.read_text().replace('"seq":1', '"seq":9'))  # fails its checksum
    with resilient.Checkpointer(root, keep=1) as ck:
        state = {"w": torch.zeros(2)}
        assert ck.load(state) == 300
        ck.save(310, {"w": torch.zeros(2)}).wait()
        ck.wait()
        assert ck.steps() == [100, 200, 300, 310]  # unsure of the lineage: nothing deleted


def test_a_crashed_saves_leftovers_are_removed_by_the_next_writer(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
    stale = root / ".tmp-step-000000000002"  # a writer killed while saving step 2
    stale.mkdir()
    (stale / "rank-00000.data").write_bytes(b"x" * 4096)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with resilient.Checkpointer(root) as ck:
        ck.save(3, {"w": torch.ones(2)}).wait()
        ck.wait()
    # close() returns after the purge thread freed what retention set aside
    assert not stale.exists()
    assert not [n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-"))]


def test_damaged_lineage_records_on_every_step_raise_not_a_fresh_start(tmp_path):
    root = tmp_path / "c"
    with resilient.Checkpointer(root) as ck:
        ck.save(4, {"w": torch.ones(2)}).wait()
    (root / "step-000000000004" / "lineage.json").write_text('{"parent":null,"seq":1}\n')
    with resilient.Checkpointer(root) as ck:
        with pytest.raises(CorruptCheckpointError, match="lineage records of steps \\[4\\]"):
            ck.load({"w": torch.zeros(2)})
        state = {"w": torch.zeros(2)}
        assert ck.load(state, step=4) == 4  # explicitly: loads
        assert torch.equal(state["w"], torch.ones(2))


def test_the_lineage_record_is_never_written_through_a_symlinked_directory(tmp_path):
    from resilient.checkpoint import root as roots

    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "c").mkdir()
    link = tmp_path / "c" / ".tmp-step-000000000007"
    link.symlink_to(outside)
    with pytest.raises(OSError) as e:
        roots.write_lineage(str(link), 7, 1, None)
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)  # O_DIRECTORY|O_NOFOLLOW on a link
    assert list(outside.iterdir()) == []
