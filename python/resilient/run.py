"""``python -m resilient.run``: the same as ``resilient run`` (see resilient.cli.run)."""

from __future__ import annotations

import sys

from resilient.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
