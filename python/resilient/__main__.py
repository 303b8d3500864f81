import sys

from resilient.cli import main

sys.exit(main())
