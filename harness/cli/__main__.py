"""`python -m harness.cli`: the same as the `oom-harness` command."""

import sys

from harness.cli.main import main

sys.exit(main())
