"""DeepSpeed ZeRO-2: the run's stream with DeepSpeed's buffers in it (`stream`)."""
