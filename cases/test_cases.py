"""Every case file in this folder, at every fidelity: `pytest` (tiny), `pytest -m gpu`, `pytest -m dcu`."""

from harness.pytest_plugin.cases import check_case


def test_case(harness_case, harness_session):
    check_case(harness_case, harness_session)
