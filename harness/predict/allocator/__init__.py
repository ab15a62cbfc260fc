"""PyTorch's caching allocator as a model (`allocator`), the run's allocation stream built from the traces
(`stream`), and a recorded timeline replayed through the model (`replay`): the reserved figure of a run
without DeepSpeed, and the building blocks of the DeepSpeed streams."""
