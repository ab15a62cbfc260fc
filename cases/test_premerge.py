"""Pre-merge config checks: each training config of a folder (default configs/examples/) is one test.

    pytest -m premerge
    pytest -m premerge --premerge-dir configs/team-a --premerge-files configs/team-a/ds_z3.json

The tests come from harness/pytest_plugin/premerge.py; a folder's premerge.yaml says what each config runs on.
"""

import pytest

from harness.pytest_plugin.premerge import check_entry

pytestmark = pytest.mark.premerge


def test_premerge(premerge_entry):
    check_entry(premerge_entry)
