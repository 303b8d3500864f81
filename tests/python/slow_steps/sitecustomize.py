"""On PYTHONPATH with RESILIENT_TEST_STEP_SLEEP=<seconds>: every optimizer step of every process
sleeps that long first (a global torch.optim step pre-hook), so a test can give a replacement
rank time to start before an unmodified example script finishes."""

import os

_DELAY = float(os.environ.get("RESILIENT_TEST_STEP_SLEEP", "0") or 0)
if _DELAY > 0:
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *_: time.sleep(_DELAY))
