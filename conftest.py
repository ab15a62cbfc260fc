# The harness's pytest plugin: turns every case file into a test per fidelity (see harness/plugin.py).
pytest_plugins = ["harness.plugin", "harness.premerge_plugin"]
