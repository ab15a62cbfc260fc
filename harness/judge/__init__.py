"""Judging runs: verdicts and claims, regression against baselines, depth extrapolation, host RAM, the session."""
