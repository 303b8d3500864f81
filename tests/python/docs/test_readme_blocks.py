"""The README's code blocks, taken from README.md and run as written (issue 44, item 2).

Each block is extracted from the file; only its placeholders are filled (the training step's
``...``, paths, the number of steps). A run is killed mid-way and resumed; the resumed run's
final weights must equal an uninterrupted run's, bit for bit.
"""


from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from doc_blocks import ROOT, block_with, code_lines

README = ROOT / "README.md"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_off_by_one_loop_is_refused_not_resumed_wrong(tmp_path):
    """The loop the README showed before (save(step) after opt.step() in a range loop) now
    raises at its first save after a resume, instead of applying a step twice."""
    import resilient

    root = tmp_path / "c"

    def run(total: int) -> None:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with resilient.Checkpointer(root, create=True) as ck:
            start = ck.load({"model": model, "optim": opt}) or 0
            for step in range(start, total):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                if step % 10 == 0:
                    ck.save(step, {"model": model, "optim": opt})

    run(15)
    with pytest.raises(ValueError, match=r"save\(10\).*after step 11, not 10"):
        run(30)
    with resilient.Checkpointer(root) as ck:
        assert ck.lineage() == [10, 0]  # nothing was saved by the refused call


def test_saving_the_loaded_step_on_resume_keeps_the_guard(tmp_path):
    """save(k) right after load() returned k (saving on resume) is fine; once the optimizer
    stepped, save(k) is refused, also after that first save(k)."""
    import resilient

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with resilient.Checkpointer(tmp_path / "c", create=True) as ck:
        ck.save(10, state).wait()
    with resilient.Checkpointer(tmp_path / "c") as ck:
        assert ck.load(state) == 10
        ck.save(10, state).wait()  # saving on resume: the state is still step 10's
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        with pytest.raises(ValueError, match=r"save\(10\)"):
            ck.save(10, state)
        ck.save(11, state).wait()
        ck.save(11, state).wait()  # a new step's number: the guard is done with step 10


def test_the_recovery_block_is_the_example_that_the_recovery_tests_run():
    """The README's recoverable loop is examples/quickstart_ddp_recoverable.py's, line for line
    (that script is run under `resilient run` with a rank killed by test_quickstart_recovery)."""
    block = block_with(README, "Recovery.adopt(")
    example = code_lines((ROOT / "examples" / "quickstart_ddp_recoverable.py").read_text())
    at = 0
    for line in code_lines(block.code):
        assert line in example[at:], f"README line {line!r} is not in the example (in order)"
        at = example.index(line, at) + 1
