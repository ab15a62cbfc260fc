"""DeepSpeed ZeRO-3: its parameter coordinator replayed over the step (`coordinator`, with the module order
`order` and the hooks as they fire `hooks`, `hook_calls`), the optimizer step's device blocks (`step`), the
step built as one stream with the gathers in it (`stream`), and when NCCL lets a gather's input go
(`gather_release`)."""
