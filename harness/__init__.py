"""oom-harness: regression cases for the GPU memory and throughput of LLM fine-tuning configurations.

Subpackages in the order data flows (each imports only those before it): models, spec, measure,
runtime, baselines, judge, predict, premerge, report, pytest_plugin, cli.
"""
