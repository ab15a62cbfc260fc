"""What a person reads: the summary table after a run and the baselines' markdown report."""
