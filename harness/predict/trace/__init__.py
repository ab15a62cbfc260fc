"""The step on fake tensors: the real model code traced on a CPU at full width with 1 and 2 layers
(`fake`), and the traces cached in-process and on disk (`trace`). What a case's step is (its
`TraceSpec`, checkpointing, zero.Init) is `harness.predict.step`, beside this package: fit, the margin and the
dispatch table read it without tracing anything."""
