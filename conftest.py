# The harness's pytest plugin: turns every case file into a test per fidelity (see harness/pytest_plugin/cases.py).
pytest_plugins = ["harness.pytest_plugin.cases", "harness.pytest_plugin.premerge"]
