"""The training stacks a case runs through, when the stack itself is the one to measure.

A case names its stack (`Case.stack`). Two are frameworks the harness runs as they are, so that what
is measured is what the user's job does, not the harness's copy of it:

* `llamafactory`: LLaMA-Factory's own argument parsing of the user's YAML, its model loader and adapter
  setup (the fp32 upcast of trainable parameters, Liger, forbidden modules, `use_reentrant_gc`,
  `flash_attn`, its QLoRA path) and its trainer (`harness.runtime.stacks.llamafactory`);
* `hf_trainer`: a `TrainingArguments` config, trained by transformers' `Trainer`
  (`harness.runtime.stacks.hf_trainer`).

Both load a random-weight checkpoint through `from_pretrained`, as users' jobs load theirs, train on
synthetic sequences at the case's length, and are measured from outside by one trainer callback
(`harness.runtime.stacks.callback`). `peft` and `plain` cases keep the harness's own loop
(`harness.runtime.build`, `engine`, `train`): a script of the user's is not a framework to import.
"""

from __future__ import annotations

from harness.spec.schema import Case, Stack

TRAINER_STACKS = (Stack.llamafactory, Stack.hf_trainer)


def through_trainer(case: Case) -> bool:
    """Whether the case trains through a framework's trainer rather than the harness's own loop."""
    return case.stack in TRAINER_STACKS
