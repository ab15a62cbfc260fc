"""Running a case: the launcher, the worker process, model loading, ballast, process trees, locks and caches."""
