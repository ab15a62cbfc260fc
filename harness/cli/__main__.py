"""`python -m harness.cli`: the same as the `oom-harness` command."""

from harness.cli.main import console

console()
