"""resilient.dcp: torch.distributed.checkpoint's save/load/async_save through resilient's engine.

A module and its optimizer (get_state_dict/set_state_dict, as torchtitan does) round-trip bit
for bit; FSDP2 state saved by 2 gloo ranks (uneven shards) loads onto 2 FSDP2 ranks, onto 2
ranks holding whole tensors and onto 1 process (DCP's planner reshards; 4 -> 2 ranks is the
bench's resharded restore, verified value for value); async_save through ResilientStager
stages into the engine's pool (also under DCP's deduplication over 2 ranks) and reuses it;
kill -9 of the writer during a save leaves the previous step loadable; a flipped data byte is
CorruptCheckpointError naming the file and offset; a hostile metadata record is refused;
nothing resilient writes is pickle.
Multi-rank phases run as torch.multiprocessing workers in a bounded subprocess."""


from __future__ import annotations

import json
import os
import time
import warnings

import pytest

from damage import flip_byte

torch = pytest.importorskip("torch")


dcp = pytest.importorskip("torch.distributed.checkpoint")


warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _model(seed: int):
    from torch import nn

    torch.manual_seed(seed)
    # 5 output rows: FSDP over 2 ranks cuts them unevenly (3, 2)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def _trained(seed: int, steps: int = 2):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": step, "note": "x"}}


def _load_into_fresh(path: str, seed: int = 99):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from resilient.dcp import ResilientStorageReader

    model, opt = _trained(seed, steps=1)  # an optimizer with state, other values
    state = _state(model, opt, 0)
    reader = ResilientStorageReader(path)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, state, reader


def _same_model_and_optim(a, ao, b, bo) -> None:
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    sa, sb = ao.state_dict(), bo.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def _save(path, state) -> None:
    from resilient.dcp import ResilientStorageWriter

    with ResilientStorageWriter(path) as w:
        dcp.save(state, storage_writer=w)


def test_module_and_optimizer_round_trip_bit_exact_one_step_per_save(tmp_path):
    from resilient.checkpoint import read_global
    from resilient.checkpoint.verify import verify_root

    root = str(tmp_path / "ckpt")
    first, first_opt = _trained(1)
    _save(root, _state(first, first_opt, 10))
    second, second_opt = _trained(2, steps=3)
    _save(root, _state(second, second_opt, 20))
    assert sorted(os.listdir(root)) == [".writer.lock", "latest", "resilient-root.json",
                                        "step-000000000000", "step-000000000001"]
    # a root loads its newest step; <root>/step-<N> (any width) that step
    model, opt, state, reader = _load_into_fresh(root)
    assert reader.step == 1 and state["extra"] == {"step": 20, "note": "x"}
    _same_model_and_optim(model, opt, second, second_opt)
    model, opt, state, reader = _load_into_fresh(os.path.join(root, "step-0"))
    assert reader.step == 0 and state["extra"]["step"] == 10
    _same_model_and_optim(model, opt, first, first_opt)
    # the step is a resilient checkpoint too: verify re-reads every chunk; read_global
    # assembles the tensors by FQN
    steps, problems = verify_root(root)
    assert steps == [0, 1] and problems == []
    tensors = read_global(root, 1)
    assert torch.equal(tensors["model.2.weight"], second.state_dict()["2.weight"])
    # checkpoint_id=<root>/step-<N> saves that step (the torchtitan naming)
    _save(os.path.join(root, "step-100"), _state(first, first_opt, 100))
    assert os.path.isdir(os.path.join(root, "step-000000000100"))
    _, _, state, reader = _load_into_fresh(root)
    assert reader.step == 100 and state["extra"]["step"] == 100
    # and it loads like any step: the values document nests each FQN where DCP's planner found
    # it, so {"model": module} finds the module's tensors (`ckpt export --key model` too)
    import resilient

    fresh = _model(0)
    with resilient.Checkpointer(root) as ck:
        assert ck.load({"model": fresh}, step=1, strict=False) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, second.state_dict()[k]), k
    # verify checks the DCP metadata record too
    meta = os.path.join(root, "step-000000000000", "dcp-metadata.json")
    flip_byte(meta, 40, 0x01)
    steps, problems = verify_root(root)
    assert [(p.step, os.path.basename(p.file)) for p in problems] == [(0, "dcp-metadata.json")]
    assert "checksum mismatch" in problems[0].message


def test_torchtitan_idiom_stateful_wrappers_and_step_folders(tmp_path):
    """torchtitan's checkpointing through the backend: Stateful wrappers around
    get_model_state_dict / get_optimizer_state_dict(flatten_optimizer_state_dict=True),
    dcp.save(..., checkpoint_id=f"{folder}/step-{n}") with only storage_writer added, and its
    discovery (the largest step-<n> directory) finding the step to load."""
    import re

    from idioms import torchtitan_wrappers
    from resilient.dcp import ResilientStorageReader, ResilientStorageWriter

    folder = str(tmp_path / "checkpoint")
    model, opt = _trained(12)
    writer = ResilientStorageWriter(folder)
    for n in (10, 20):
        with torch.no_grad():
            model[0].weight.add_(n)
        wrapped, wrapped_opt = torchtitan_wrappers(model, opt)
        dcp.save({"model": wrapped, "optimizer": wrapped_opt, "train_state": {"step": n}},
                 checkpoint_id=os.path.join(folder, f"step-{n}"), storage_writer=writer)
    writer.close()
    steps = [int(m.group(1)) for f in os.listdir(folder)
             if (m := re.fullmatch(r"step-(\d+)", f))]  # torchtitan's discovery
    assert max(steps) == 20
    fresh, fresh_opt = _trained(13, steps=1)
    wrapped, wrapped_opt = torchtitan_wrappers(fresh, fresh_opt)
    state = {"model": wrapped, "optimizer": wrapped_opt, "train_state": {"step": 0}}
    dcp.load(state, checkpoint_id=os.path.join(folder, f"step-{max(steps)}"),
             storage_reader=ResilientStorageReader(folder))
    assert state["train_state"] == {"step": 20}
    _same_model_and_optim(fresh, fresh_opt, model, opt)


_PICKLE_MARKS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"data.pkl", b"PK\x03\x04")


def test_nothing_resilient_writes_is_pickle(tmp_path):
    """Resilient's own records are JSON; in the data files, the only pickle-looking bytes are
    inside the extents of DCP's bytes items (its torch.save'd non-tensor values, stored
    opaque), and a tensor-only state has none at all."""
    model, opt = _trained(3)
    tensors_only = str(tmp_path / "t")
    _save(tensors_only, {"model": model.state_dict()})
    mixed = str(tmp_path / "m")
    _save(mixed, _state(model, opt, 5))
    for root in (tensors_only, mixed):
        step = os.path.join(root, "step-000000000000")
        for name in ("manifest.json", "rank-0.json"):
            json.load(open(os.path.join(step, name)))
        body = open(os.path.join(step, "dcp-metadata.json")).read().split("\n")[0]
        assert json.loads(body)["format"] == "resilient-dcp-metadata"
        assert not [f for f in os.listdir(step) if f.endswith((".metadata", ".pt", ".pkl"))]
        doc = json.load(open(os.path.join(step, "manifest.json")))
        entries = doc["tensors"]
        byte_fqns = {k for k, v in json.loads(body)["state"].items() if v["type"] == "bytes"}
        opaque = [(c["off"], c["off"] + c["len"]) for e in entries
                  if e["name"][2:].split("#@")[0] in byte_fqns for c in e["chunks"]]
        data = open(os.path.join(step, "rank-00000.data"), "rb").read()
        for mark in _PICKLE_MARKS:
            at = data.find(mark)
            while at >= 0:
                assert any(a <= at < b for a, b in opaque), (root, mark, at)
                at = data.find(mark, at + 1)
        for name in os.listdir(step):
            if not name.endswith(".data"):
                raw = open(os.path.join(step, name), "rb").read()
                assert not any(m in raw for m in _PICKLE_MARKS), name
    assert not byte_fqns or opaque  # the mixed state had bytes items, the other none
    data = open(os.path.join(tensors_only, "step-000000000000", "rank-00000.data"), "rb").read()
    assert not any(m in data for m in _PICKLE_MARKS)


def _flip(path: str, offset: int) -> None:
    flip_byte(path, offset, 0x40)


def _dcp_error(exc: BaseException) -> BaseException:
    """The exception inside DCP's CheckpointException (rank 0's)."""
    failures = getattr(exc, "failures", None)
    if failures:
        wrapped = next(iter(failures.values()))  # (exception, its traceback)
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return exc


def test_a_flipped_data_byte_is_corrupt_checkpoint_error_naming_file_and_offset(tmp_path):
    import resilient

    root = str(tmp_path / "c")
    model, opt = _trained(4)
    _save(root, _state(model, opt, 1))
    step = os.path.join(root, "step-000000000000")
    doc = json.load(open(os.path.join(step, "manifest.json")))
    entry = next(e for e in doc["tensors"] if e["name"].startswith("S/model.0.weight#@"))
    chunk = entry["chunks"][0]
    _flip(os.path.join(step, "rank-00000.data"), chunk["off"] + 7)
    with pytest.raises(BaseException) as info:
        _load_into_fresh(root)
    err = _dcp_error(info.value)
    assert isinstance(err, resilient.CorruptCheckpointError), repr(err)
    assert err.path.endswith("rank-00000.data") and err.offset == chunk["off"], (err.path,
                                                                                err.offset)


def _rewrite_metadata(step: str, edit) -> None:
    from resilient import _C

    path = os.path.join(step, "dcp-metadata.json")
    doc = json.loads(open(path).read().split("\n")[0])
    edit(doc)
    body = json.dumps(doc, separators=(",", ":"))
    with open(path, "w") as f:
        f.write(f"{body}\n{_C.xxh3_hex(body.encode())}\n")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["state"]["model.0.bias"].update(type="pickle"), "unknown storage type"),
    (lambda d: d["state"]["model.0.bias"].update(dtype="os.system"), "unknown dtype"),
    (lambda d: d.update(planner_data={"x": [{"__reduce__": "eval"}]}), "planner_data"),
    (lambda d: d["state"]["model.0.bias"]["chunks"][0].update(sizes=[99]), "outside"),
    (None, "checksum mismatch"),
])
def test_a_hostile_or_damaged_metadata_record_is_refused(tmp_path, edit, message):
    import resilient
    from resilient.dcp import ResilientStorageReader

    root = str(tmp_path / "h")
    model, opt = _trained(5)
    _save(root, {"model": model.state_dict()})
    step = os.path.join(root, "step-000000000000")
    if edit is None:
        path = os.path.join(step, "dcp-metadata.json")
        _flip(path, 20)
    else:
        _rewrite_metadata(step, edit)
    with pytest.raises(BaseException) as info:
        dcp.load({"model": _model(0).state_dict()},
                 storage_reader=ResilientStorageReader(root))
    err = _dcp_error(info.value)
    assert isinstance(err, resilient.CorruptCheckpointError), repr(err)
    assert message in str(err) and "dcp-metadata.json" in str(err)


def test_a_custom_planner_data_that_is_not_json_is_refused_when_saving(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner

    from resilient.dcp import ResilientStorageWriter

    class Odd(DefaultSavePlanner):
        def create_global_plan(self, plans):
            plans, md = super().create_global_plan(plans)
            md.planner_data = object()
            return plans, md

    root = str(tmp_path / "p")
    with pytest.raises(BaseException, match="planner_data") as info:
        dcp.save({"w": torch.ones(3)}, storage_writer=ResilientStorageWriter(root),
                 planner=Odd())
    assert "DefaultSavePlanner" in str(_dcp_error(info.value))
    assert [n for n in os.listdir(root) if n.startswith(("step-", ".tmp-"))] == []


def test_a_resilient_native_step_says_which_reader(tmp_path):
    import resilient
    from resilient.dcp import ResilientStorageReader

    root = str(tmp_path / "n")
    with resilient.Checkpointer(root, distributed=False) as ck:
        ck.save(3, {"w": torch.ones(2)}).wait()
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(2)},
                 storage_reader=ResilientStorageReader(root))
    assert "Checkpointer" in str(_dcp_error(info.value))


def test_ranks_that_found_different_newest_steps_are_refused_before_reading(tmp_path):
    """A save committing while the ranks of a load list the root: rank 0's global plan sees
    two steps and refuses (every rank then raises through DCP), naming the way out."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from resilient.dcp import ResilientStorageReader

    reader = ResilientStorageReader(tmp_path)
    same = [LoadPlan([], storage_data=4), LoadPlan([], storage_data=4)]
    assert reader.prepare_global_plan(same) == same
    with pytest.raises(ValueError, match=r"different newest steps .*\[4, 5\].*step-<N>"):
        reader.prepare_global_plan([LoadPlan([], storage_data=4), LoadPlan([], storage_data=5)])


def _async_saves(root: str, stager_of, steps: int = 3) -> tuple[list, list]:
    """async_save of a module being trained: each save's state, and after each one stager_of's
    buffer_bytes; the training changes the parameters while the save is written."""
    from resilient.dcp import ResilientStorageWriter

    model, opt = _trained(6)
    writer = ResilientStorageWriter(root)
    stager = stager_of(writer)
    saved, held = [], []
    for step in range(steps):
        future = dcp.async_save(_state(model, opt, step), storage_writer=writer,
                                async_stager=stager)
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        future.result()
        held.append(stager.buffer_bytes)
    assert not writer._staged  # every staging was written
    writer.close()
    return saved, held


def _loads_as_saved(root: str, saved: list) -> None:
    from resilient.dcp import ResilientStorageReader

    for step, expected in enumerate(saved):
        got = _model(0).state_dict()
        dcp.load({"model": got}, storage_reader=ResilientStorageReader(f"{root}/step-{step}"))
        for k in got:
            assert torch.equal(got[k], expected[k]), (step, k)


def test_async_save_stages_into_the_writers_pool_and_reuses_it(tmp_path):
    from resilient.dcp import ResilientStager

    root = str(tmp_path / "a")
    saved, held = _async_saves(root, ResilientStager)
    assert held[0] == held[1] == held[2] > 0  # the engine's slabs, reused by every save
    _loads_as_saved(root, saved)


def test_an_unbound_stager_reuses_buffers_of_its_own(tmp_path):
    from resilient.dcp import ResilientStager

    root = str(tmp_path / "u")
    stagers = []
    saved, held = _async_saves(root, lambda w: stagers.append(ResilientStager()) or stagers[0])
    assert held[0] == held[1] == held[2] > 0
    assert stagers[0].allocations == len(stagers[0]._buffers)
    _loads_as_saved(root, saved)


def test_pool_staged_placeholders_are_written_by_their_writer_only(tmp_path):
    """What a bound stager hands DCP are meta placeholders: another writer fails on them instead
    of writing wrong bytes; a staged state dropped unsaved gives its slabs back."""
    import gc

    from resilient.dcp import ResilientStager, ResilientStorageWriter

    model, opt = _trained(4)
    writer = ResilientStorageWriter(str(tmp_path / "w"))
    stager = ResilientStager(writer)
    staged = stager.stage(_state(model, opt, 0))
    assert staged["model"]["0.weight"].is_meta and writer._staged
    with pytest.raises(BaseException) as err:  # DCP's CheckpointException
        dcp.save(staged, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")))
    assert "meta tensor" in str(_dcp_error(err.value))
    with pytest.raises(BaseException) as err:  # DCP's CheckpointException
        dcp.save(staged, storage_writer=ResilientStorageWriter(str(tmp_path / "other")))
    assert "placeholder (a meta tensor) that this writer did not stage" in str(
        _dcp_error(err.value))
    del staged, err  # the traceback's frames hold the staged state too
    gc.collect()
    assert not writer._staged
    # the pool is whole again: a save through the stager still commits
    dcp.async_save(_state(model, opt, 1), storage_writer=writer, async_stager=stager).result()
    assert writer.last_step == 0
    writer.close()


def test_overlapping_async_saves_of_one_writer_commit_distinct_steps(tmp_path):
    """A second async_save planned while the first is still committing (nobody waited for its
    future) takes the next step, and each commit is its own save's."""
    from resilient.dcp import ResilientStager, ResilientStorageReader, ResilientStorageWriter

    class Slow(ResilientStorageWriter):
        def finish(self, metadata, results):
            time.sleep(1.0)
            super().finish(metadata, results)

    root = str(tmp_path / "o")
    writer = Slow(root)
    first = {"w": torch.full((64,), 1.0), "n": 1}
    second = {"w": torch.full((64,), 2.0), "n": 2}
    futures = [dcp.async_save(state, storage_writer=writer, async_stager=ResilientStager())
               for state in (first, second)]
    for f in futures:
        f.result()
    writer.close()
    # numbered in the order DCP planned them (the two executor threads race: not necessarily
    # the call order), committed in that order: the head is step 1
    got = []
    for step in (0, 1):
        g = {"w": torch.zeros(64), "n": 0}
        dcp.load(g, storage_reader=ResilientStorageReader(f"{root}/step-{step}"))
        got.append(g)
    assert sorted(g["n"] for g in got) == [1, 2]
    for g in got:
        assert torch.equal(g["w"], (first if g["n"] == 1 else second)["w"])
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    newest = {"w": torch.zeros(64), "n": 0}
    dcp.load(newest, storage_reader=ResilientStorageReader(root))
    assert newest["n"] == got[1]["n"]


def test_a_failed_write_gives_its_staging_back(tmp_path):
    """A save that fails in write_data (here: its engine) releases the staged slabs at once,
    not when the failed future's traceback is collected; the next save commits without
    waiting for the failed one (which never will)."""
    from resilient.dcp import ResilientStager, ResilientStorageWriter

    model, opt = _trained(5)
    writer = ResilientStorageWriter(str(tmp_path / "f"))
    stager = ResilientStager(writer)
    dcp.async_save(_state(model, opt, 0), storage_writer=writer, async_stager=stager).result()
    real = writer._engine

    def broken(*args):
        raise OSError("the disk went away")

    writer._engine = broken
    future = dcp.async_save(_state(model, opt, 1), storage_writer=writer, async_stager=stager)
    with pytest.raises(BaseException) as err:
        future.result()
    assert "the disk went away" in str(_dcp_error(err.value))
    assert not writer._staged  # released although `err` still holds the traceback
    writer._engine = real
    dcp.async_save(_state(model, opt, 2), storage_writer=writer, async_stager=stager).result()
    assert writer.last_step == 1 and not writer._staged
    writer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_through_the_writer_and_a_pinned_stager(tmp_path):
    """CUDA tensors reach the engine through its streams; ResilientStager stages them into the
    engine's pinned pool, reused by every save; every step loads back onto the device bit for
    bit."""
    from resilient.dcp import ResilientStager, ResilientStorageReader, ResilientStorageWriter

    root = str(tmp_path / "g")
    model = _model(11).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6, device="cuda")).square().mean().backward()
    opt.step()
    writer = ResilientStorageWriter(root)
    dcp.save(_state(model, opt, 0), storage_writer=writer)  # step 0: blocking, from the device
    expected = [{k: v.clone() for k, v in model.state_dict().items()}]
    stager = ResilientStager(writer)
    held = []
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        expected.append({k: v.clone() for k, v in model.state_dict().items()})
        future = dcp.async_save(_state(model, opt, step), storage_writer=writer,
                                async_stager=stager)
        with torch.no_grad():  # the staged copy is complete: training may go on
            for p in model.parameters():
                p.zero_()
        future.result()
        held.append(stager.buffer_bytes)
        with torch.no_grad():
            for p, v in zip(model.parameters(), expected[-1].values()):
                p.copy_(v)
    assert next(iter(writer._engines.values())).pool_pinned
    assert held[0] == held[1] > 0
    writer.close()
    for step in (0, 1, 2):
        got = _model(0).cuda().state_dict()
        dcp.load({"model": got}, storage_reader=ResilientStorageReader(f"{root}/step-{step}"))
        for k in got:
            assert got[k].is_cuda and torch.equal(got[k], expected[step][k]), (step, k)
