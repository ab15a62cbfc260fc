"""Auto-fit: from a training config that runs out of memory to the fastest config predicted to fit."""
