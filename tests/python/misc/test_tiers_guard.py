"""tests/python/tiers.py's guard, run on throw-away test files (pytester, in this process): a
unit file that starts a Python process, in a test or in a fixture of any scope, fails with the
file to move it to; the multiproc file it names may; every file gets its tier's marker."""


from __future__ import annotations

import pytest

STARTS = "subprocess.Popen([sys.executable, '-c', 'pass']).wait()"


@pytest.mark.parametrize("where", ["test", "function fixture", "module fixture",
                                   "session fixture"])
def test_a_unit_file_that_starts_python_fails_and_names_the_file(tiers_dir: pytest.Pytester,
                                                                 where: str) -> None:
    body = {"test": f"def test_x():\n    {STARTS}\n",
            "function fixture": f"@pytest.fixture\ndef f():\n    {STARTS}\n\n"
                                "def test_x(f):\n    pass\n"}.get(where)
    if body is None:
        scope = where.split()[0]
        body = (f"@pytest.fixture(scope='{scope}')\ndef f():\n    {STARTS}\n\n"
                "def test_x(f):\n    pass\n")
    tiers_dir.makepyfile(test_probe="import subprocess, sys\nimport pytest\n\n" + body)
    result = tiers_dir.runpytest_inprocess("-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*is a unit test but starts the program*"
                                 "move it to test_probe_multiproc.py*"])


def test_a_unit_file_may_not_start_a_multiprocessing_process(tiers_dir: pytest.Pytester) -> None:
    tiers_dir.makepyfile(test_probe="import multiprocessing\n\ndef test_x():\n"
                                    "    p = multiprocessing.get_context('spawn').Process("
                                    "target=print)\n    p.start()\n    p.join()\n")
    result = tiers_dir.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*is a unit test but starts a *Process*"])
