"""The pytest plugin (`plugin`, registered through the pytest11 entry point): case tests and pre-merge tests."""
