"""The benchmark drivers that only run on the GPU machine still import and find their examples
here (a layout change once broke scripts/gpu_recovery_bench.py and benchmarks/recovery_bench.py
without any test noticing), and the resilient-run recovery bench measures from rank reports."""

from __future__ import annotations

import importlib.util
import json
import py_compile
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").glob("*.py"))
                         + sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_every_driver_compiles(path: Path) -> None:
    py_compile.compile(str(path), doraise=True)


def test_the_recovery_benches_find_their_examples() -> None:
    pytest.importorskip("torch")
    assert load(ROOT / "benchmarks" / "recovery_bench.py").EXAMPLE.is_file()
    assert load(ROOT / "benchmarks" / "run_recovery_bench.py").EXAMPLE.is_file()


def test_run_recovery_bench_measures_from_the_kill_to_the_joiners_first_collective(
        tmp_path: Path) -> None:
    bench = load(ROOT / "benchmarks" / "run_recovery_bench.py")
    (tmp_path / "rank0.killed").write_text("100.0")

    def report(name: str, joined: bool, events: list[tuple[str, float]]) -> None:
        (tmp_path / name).write_text(json.dumps({
            "joined": joined, "world_size": 2, "step": 30,
            "timeline": [{"kind": k, "time_mono": t} for k, t in events]}))

    report("rank1.json", False, [("first_collective", 99.0), ("join_admitted", 100.3),
                                 ("first_collective", 101.2)])
    report("rank1048576.json", True, [("first_collective", 101.5)])
    res = bench.measure("spare", tmp_path, kill_rank=0)
    assert res["seconds"] == pytest.approx(1.5) and res["admitted_s"] == pytest.approx(0.3)
    assert res["survivors_s"] == pytest.approx(1.2)
    (tmp_path / "rank1048576.json").unlink()
    with pytest.raises(RuntimeError, match="no rank joined"):
        bench.measure("spare", tmp_path, kill_rank=0)
