"""The ```python blocks of docs/*.md that run in this process, taken from the files and run as
written (issue 44): a prelude defines the names a block assumes (a small model, a temporary
root), only placeholders are substituted (doc_blocks.substitute), and each test checks what the
text around its block says the block does.

COVERAGE names, for every ```python block of README.md and docs/*.md, the test that runs it;
test_every_docs_block_is_run_by_a_test fails for a block without an entry, saying how to add
one. Blocks that start processes: test_docs_blocks_multiproc.py; blocks that need etcd or an
object store: test_docs_blocks_system.py.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import resilient
from doc_blocks import ROOT, block_with, python_blocks, run_block, shell_command, substitute

DOCS = ROOT / "docs"
HERE = Path(__file__).resolve().parent  # docs/: the blocks' tests

#: (file, a line of text the block contains, the test that runs it: file::function). The
#: test's file must contain the text too (it takes the block by it).
COVERAGE = [
    ("README.md", "resilient.Checkpointer(",
     "test_readme_blocks_multiproc.py::test_the_single_process_quick_start_resumes_exactly"),
    ("README.md", "CheckpointManager(",
     "test_readme_blocks_multiproc.py::test_the_ddp_quick_start_resumes_exactly_under_torchrun"),
    ("README.md", "ResilientStorageWriter(",
     "test_readme_blocks_multiproc.py::test_the_dcp_block_saves_and_loads"),
    ("README.md", "Recovery.adopt(",
     "test_readme_blocks.py::test_the_recovery_block_is_the_example_that_the_recovery_tests_run"),
    ("docs/STATE.md", "step = ckpt.load(",
     "test_docs_blocks.py::test_state_load_starts_fresh_then_restores_everything"),
    ("docs/ckpt.md", "AutoModelForCausalLM.from_pretrained(",
     "test_docs_blocks.py::test_ckpt_export_loads_with_from_pretrained"),
    ("docs/dcp.md", "ResilientStager(writer)",
     "test_docs_blocks.py::test_dcp_saves_step_n_plus_1_and_1200_and_loads_them_back"),
    ("docs/detector.md", "FailureDetector(store, rank, world_size",
     "test_docs_blocks_multiproc.py::test_detector_agrees_on_a_killed_rank"),
    ("docs/io.md", 'S3Tier("s3://bucket/run1", keep=20)',
     "test_docs_blocks_system.py::"
     "test_tiers_copy_each_commit_to_the_file_tier_and_the_object_store"),
    ("docs/recovery.md", "checkpointer=Checkpointer(root, distributed=False)",
     "test_docs_blocks_multiproc.py::test_recovery_survivors_train_on_in_the_same_processes"),
    ("docs/recovery.md", "rec = Recovery.adopt(model, opt, global_batch=32",
     "test_docs_blocks_multiproc.py::test_recovery_adopt_takes_the_scripts_group_and_ddp"),
    ("docs/recovery.md", "x, y = batch(step)",
     "test_docs_blocks_multiproc.py::"
     "test_recovery_attempt_redoes_the_failed_step_on_the_new_group"),
    ("docs/recovery.md", "rec = Recovery.adopt(model, opt, global_batch=gb",
     "test_docs_blocks_multiproc.py::test_recovery_samplers_use_every_sample_of_the_epoch_once"),
    ("docs/recovery.md", "rec = Recovery.adopt(model, opt, checkpointer=ckpt",
     "test_docs_blocks_multiproc.py::"
     "test_recovery_fsdp2_build_shards_the_model_again_over_the_survivors"),
    ("docs/store.md", 'init_method="etcd://',
     "test_docs_blocks_system.py::test_etcd_rendezvous_with_a_member_down"),
    ("docs/straggler.md", "recovery_loop.request_exclusion(rank",
     "test_docs_blocks_multiproc.py::test_straggler_monitor_names_the_slowed_rank"),
    ("docs/straggler.md", "exclude_persistent_straggler(rec))",
     "test_docs_blocks_multiproc.py::"
     "test_straggler_exclusion_policy_removes_the_rank_through_recovery"),
    ("docs/training.md", "model = DDP(model, find_unused_parameters=True)",
     "test_docs_blocks_multiproc.py::test_training_quick_start_resumes_bit_exact_after_a_kill"),
    ("docs/training.md", "ShardSpec.split((HIDDEN, DIM), dim=0",
     "test_docs_blocks_multiproc.py::"
     "test_training_shard_specs_save_tp2_slices_and_load_them_on_tp1"),
]


def _test_exists(test: str) -> str | None:
    """Why `file::function` names no test, or None."""
    file, _, name = test.partition("::")
    path = HERE / file
    if not path.exists():
        return f"{file} does not exist"
    tree = ast.parse(path.read_text())
    if not any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body):
        return f"{file} has no test function {name}"
    return None


def test_every_docs_block_is_run_by_a_test():
    """Each ```python block of README.md and docs/*.md has one COVERAGE entry, and the entry's
    test exists and takes the block by the entry's text."""
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    problems = []
    for path in files:
        name = str(path.relative_to(ROOT))
        for block in python_blocks(path):
            entries = [e for e in COVERAGE if e[0] == name and e[1] in block.code]
            if not entries:
                first = next((line for line in block.code.splitlines() if line.strip()), "")
                problems.append(
                    f"{block} (starting {first.strip()!r}) is run by no test: write one that "
                    "takes the block from the file (doc_blocks.block_with), runs it and checks "
                    "what the text says it does (in-process: test_docs_blocks.py; starting "
                    "processes: test_docs_blocks_multiproc.py; etcd or a server: "
                    "test_docs_blocks_system.py), then add (file, a line of the block, "
                    "'test_file.py::test_name') to COVERAGE in tests/python/test_docs_blocks.py")
            elif len(entries) > 1:
                problems.append(f"{block} has {len(entries)} COVERAGE entries: {entries}")
    for file, text, test in COVERAGE:
        found = [b for b in python_blocks(ROOT / file) if text in b.code]
        if len(found) != 1:
            problems.append(f"COVERAGE entry ({file!r}, {text!r}) matches {len(found)} blocks "
                            "(the docs changed? pick a line that names one block)")
        why = _test_exists(test)
        if why:
            problems.append(f"COVERAGE entry ({file!r}, {text!r}): {why}")
        elif text not in (HERE / test.partition("::")[0]).read_text():
            problems.append(f"COVERAGE entry ({file!r}, {text!r}): {test.partition('::')[0]} "
                            "does not contain the text it is said to take the block by")
    assert not problems, "\n".join(problems)


# -- docs/STATE.md: "load() returns normally only after restoring everything" ---------------
def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for _ in range(3):
        _step(model, opt)
        sched.step()
    return model, opt, sched


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()


def _tensors(obj: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a (nested) state dict, by path: tensors cloned, other values as they are."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
        return out
    return {prefix: obj.clone() if isinstance(obj, torch.Tensor) else copy.deepcopy(obj)}


def _assert_same(want: dict, got: dict, what: str) -> None:
    assert want.keys() == got.keys(), what
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, got[k]) and v.dtype == got[k].dtype, f"{what}: {k}"
        else:
            assert v == got[k], f"{what}: {k}: {v!r} != {got[k]!r}"


def test_state_load_starts_fresh_then_restores_everything(tmp_path):
    """The block on a fresh root: load() returns None and the root is created. After a save of
    step 3, the block run with other objects returns 3 with model, optimizer and scheduler
    restored bit-exact; save(3) right after load() is fine, and after an optimizer step
    raises ValueError (it would label step 4's state as step 3)."""
    block = block_with(DOCS / "STATE.md", "step = ckpt.load(")
    root = tmp_path / "root"
    model, opt, sched = _trained(0)
    ns = run_block(block, block.code, {"resilient": resilient, "root": str(root),
                                       "model": model, "opt": opt, "sched": sched})
    assert ns["step"] is None and root.is_dir()
    ns["ckpt"].save(3, {"model": model, "optim": opt, "sched": sched}).wait()
    ns["ckpt"].close()
    saved = _tensors({"model": model.state_dict(), "optim": opt.state_dict(),
                      "sched": sched.state_dict()})

    model2, opt2, sched2 = _trained(1)
    ns = run_block(block, block.code, {"resilient": resilient, "root": str(root),
                                       "model": model2, "opt": opt2, "sched": sched2})
    assert ns["step"] == 3
    _assert_same(saved, _tensors({"model": model2.state_dict(), "optim": opt2.state_dict(),
                                  "sched": sched2.state_dict()}), "restored")
    ns["ckpt"].save(3, {"model": model2, "optim": opt2, "sched": sched2}).wait()  # on resume
    ns["ckpt"].close()

    model3, opt3, sched3 = _trained(2)
    ns = run_block(block, block.code, {"resilient": resilient, "root": str(root),
                                       "model": model3, "opt": opt3, "sched": sched3})
    assert ns["step"] == 3
    _step(model3, opt3)
    with pytest.raises(ValueError, match=r"save\(3\).*after step 4, not 3"):
        ns["ckpt"].save(3, {"model": model3, "optim": opt3, "sched": sched3})
    ns["ckpt"].close()


# -- docs/ckpt.md: "Export of a Hugging Face model" -----------------------------------------
def test_ckpt_export_loads_with_from_pretrained(tmp_path, monkeypatch, capsys):
    """The docs' export command (run in this process through the console script's main), on a
    tiny GPT-2 saved as {"model": model, ...}, then the block: from_pretrained("./hf-out")
    gives identical tensors, the embedding and the head tied again (nothing downloaded: a
    local config)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from resilient.cli import main

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    trained = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    trained(ids, labels=ids).loss.backward()
    opt.step()
    root = tmp_path / "run42"
    with resilient.Checkpointer(root, create=True, distributed=False) as ck:
        ck.save(1, {"model": trained, "optim": opt}).wait()
    monkeypatch.chdir(tmp_path)  # the docs' relative paths, as written
    trained.config.save_pretrained("./base-model")

    argv = shell_command(DOCS / "ckpt.md", "--hf-config ./base-model")
    assert argv[:4] == ["resilient", "ckpt", "export", "/ckpt/run42"], argv
    assert main([*argv[1:3], str(root), *argv[4:]]) == 0, capsys.readouterr()

    block = block_with(DOCS / "ckpt.md", "AutoModelForCausalLM.from_pretrained(")
    ns = run_block(block, block.code,
                   {"AutoModelForCausalLM": transformers.AutoModelForCausalLM})
    loaded = ns["model"]
    want, got = trained.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied


# -- docs/dcp.md -----------------------------------------------------------------------------
DCP_CHECK = """
def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _leaves(v, f"{prefix}/{k}").items()}
    return {prefix: obj.clone() if isinstance(obj, torch.Tensor) else obj}

def _scramble():  # every tensor of the state zeroed, the step forgotten: a load must fill them
    for sd in (state["model"], *state["optim"]["state"].values()):
        for t in sd.values():
            if isinstance(t, torch.Tensor):
                t.zero_()
    state["step"] = -1

def _check(what):
    got = _leaves(state)
    assert got.keys() == SAVED.keys(), what
    for k, v in SAVED.items():
        assert (torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k]), \\
            f"{what}: {k}"
    LOADED.append(what)
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a group
def test_dcp_saves_step_n_plus_1_and_1200_and_loads_them_back(tmp_path):
    """The block in one process (DCP's no-process-group path): the root-path save commits
    the next step (0 in a new root), the step-1200 path commits step 1200, each load fills
    a zeroed state bit-exact, and the async save with the stager commits step 1201."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from resilient.dcp import ResilientStorageReader

    block = block_with(DOCS / "dcp.md", "ResilientStager(writer)")
    root = str(tmp_path / "run42")
    code = substitute(
        block,
        ('"/ckpt/run42', '"' + root, 7),
        ("\ndcp.load(state, storage_reader=", "\n_scramble()\ndcp.load(state, storage_reader="),
        ("# the newest\n", "# the newest\n_check('the newest')\n_scramble()\n"),
        ('optim_state_dict=state["optim"])\n',
         'optim_state_dict=state["optim"])\n_check("step 1200")\n'),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim)
    _step(model, optim)
    ns: dict = {"torch": torch, "model": model, "optim": optim, "step": 7, "LOADED": []}
    exec(DCP_CHECK, ns)  # noqa: S102
    msd, osd = get_state_dict(model, optim)
    ns["SAVED"] = ns["_leaves"]({"model": msd, "optim": osd, "step": 7})
    run_block(block, code, ns)
    assert ns["LOADED"] == ["the newest", "step 1200"]
    _assert_same({k: v for k, v in ns["SAVED"].items() if k.startswith("/model")},
                 {f"/model/{k}": v for k, v in model.state_dict().items()}, "set_state_dict")
    with resilient.Checkpointer(root) as ck:
        assert ck.lineage() == [1201, 1200, 0]
    got = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}
    dcp.load(got, checkpoint_id=f"{root}/step-1201", storage_reader=ResilientStorageReader(root))
    _assert_same({k: v for k, v in ns["SAVED"].items() if k.startswith("/model")},
                 ns["_leaves"](got), "step 1201 (the async save)")
