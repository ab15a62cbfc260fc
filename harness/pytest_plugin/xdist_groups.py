"""pytest-xdist's `--dist loadgroup` with the case items as one group, on any pytest.

The case items must run in one worker: the session that runs them starts the selected tiny runs
in the background and lends one case's run to another case's claims, and in two workers each
would run every case. xdist groups by the `xdist_group` mark, which its worker writes into the
item's node id; pytest 9.2 keeps node ids where xdist 3.8 no longer writes, so the marks are lost
and the groups with them. This scheduler puts every item collected from the case folder into one
group from its node id alone, and keeps xdist's groups for the other items.

A test that takes a case's run from the cases' session (the repository's own tests, through
`BESIDE_THE_CASES`) joins the group by its parameter id, so it shares the case item's run instead of
making its own; so does a test that runs a case of its own on the CPU, whose workers then fork from
the zygotes that worker has started already (harness.runtime.zygote: 6-7 CPU-s of imports each, once
per process), and so do the tests of a file whose module fixtures are too costly to set up in both
workers (the repository's browser test builds a report and starts Chromium). Collected before the
case folder, such tests run first in the group; the first of them starts the case items' runs in the
background (harness.pytest_plugin.cases.start_beside), so the runs go on while they run.
"""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadGroupScheduling

GROUP = "oom-harness-cases"  # also the case items' xdist_group mark


def beside_the_cases(nodeid: str) -> bool:
    """A test parametrized with the id GROUP (`pytest.param(..., id=GROUP)`)."""
    return nodeid.endswith(f"[{GROUP}]")


class CaseGroupScheduling(LoadGroupScheduling):
    """xdist's load-group scheduling, with every item of the case folder in `GROUP`."""

    def __init__(self, config, log=None, case_dir: Path | None = None):
        super().__init__(config, log)
        self._root = Path(config.rootpath)
        self._case_dir = case_dir

    def _split_scope(self, nodeid: str) -> str:
        file = nodeid.split("::", 1)[0]
        if self._case_dir is not None and (self._root / file).resolve().parent == self._case_dir:
            return GROUP
        if beside_the_cases(nodeid):
            return GROUP
        return super()._split_scope(nodeid)
