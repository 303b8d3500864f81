"""Saving a step that already exists replaces it in the lineage (issue 44, item 1).

The loops users write re-save steps: a job resumed from step 200 saves 200 again (the
manager's "save on resume", torchtitan's save at the loaded step), a DCP user replaces
``root/step-300`` atomically, a loop re-runs its last step. A replaced step takes the replaced
one's parent, the old copy stays loadable until the new one is committed, and retention keeps
``keep`` steps of the lineage.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_lineage_resave.py."""

from __future__ import annotations

from test_lineage_resave import _loaded, _w

import resilient


# A lost lineage.json on the newest step (issue 50, item 7) -----------------------------------
def test_a_lost_lineage_record_is_treated_as_damaged_and_deletes_nothing(tmp_path, caplog):
    import os
    import subprocess
    import sys

    root = tmp_path / "c"
    with resilient.Checkpointer(root, keep=2, create=True) as ck:
        for s in (100, 200, 300):
            ck.save(s, _w(s)).wait()
        ck.wait_cleanup()
        assert ck.steps() == [200, 300]
    os.remove(root / "step-000000000300" / "lineage.json")
    with resilient.Checkpointer(root, keep=2) as ck:
        got = _loaded(ck)  # the parent, with a warning naming the step it did not take
        assert got == (200, 200.0)
        assert any("300" in r.getMessage() and "damaged" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        ck.save(400, _w(400)).wait()
        ck.wait_cleanup()
        assert 300 in ck.steps()  # the intact newest step is not deleted by retention
        assert any("retention skipped" in r.getMessage() for r in caplog.records)
    cli = [sys.executable, "-m", "resilient", "ckpt", "verify", str(root), "--step", "300"]
    p = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "lineage record is missing" in p.stdout + p.stderr, p
    with resilient.Checkpointer(root) as ck:  # it can still be loaded by name
        assert _loaded(ck, 300) == (300, 300.0)
