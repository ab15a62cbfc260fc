"""The `oom-harness` command line: one module per command, assembled by `main`."""
