"""What a run measures: run records, memory trackers, clocks and FLOPs."""
