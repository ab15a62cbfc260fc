"""Architectures: the registry of real configs kept as data, the tiny rule, config.json folders, and fla's CPU path."""
