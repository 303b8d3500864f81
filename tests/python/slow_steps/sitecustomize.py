"""On PYTHONPATH with RESILIENT_TEST_STEP_SLEEP=<seconds>: every optimizer step of every process
sleeps that long first (a global torch.optim step pre-hook), so a test can give a replacement
rank time to start before an unmodified example script finishes. With
RESILIENT_TEST_STEP_SLEEP_UNTIL=<path>, only until that file exists (the test saw what it waited
for; the rest of the run goes at full speed)."""

import os

_DELAY = float(os.environ.get("RESILIENT_TEST_STEP_SLEEP", "0") or 0)
_UNTIL = os.environ.get("RESILIENT_TEST_STEP_SLEEP_UNTIL", "")
if _DELAY > 0:
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def _sleep(*_: object) -> None:
        if not (_UNTIL and os.path.exists(_UNTIL)):
            time.sleep(_DELAY)

    register_optimizer_step_pre_hook(_sleep)
