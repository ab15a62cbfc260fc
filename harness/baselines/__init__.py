"""Measured figures kept as data with their provenance: the store, blessing, pytest-benchmark JSON."""
