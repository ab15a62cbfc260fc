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

import importlib.util
import os
import sys

from harness.spec.schema import Case, Stack

TRAINER_STACKS = (Stack.llamafactory, Stack.hf_trainer)
# A framework that pins its own versions of transformers and peft lives in an environment of its own
# (LLaMA-Factory 0.9.5: transformers <= 5.6.0, peft <= 0.18.1). Its cases' workers run on that
# environment's interpreter, named by this variable (the pytest ini key harness_llamafactory_python sets
# it), where the harness's own interpreter lacks the framework; the harness is installed there too.
PYTHON_VARIABLE = {Stack.llamafactory: "HARNESS_LLAMAFACTORY_PYTHON"}
_MODULE = {Stack.llamafactory: "llamafactory"}
_SETUP = {Stack.llamafactory: "./setup.sh --stack llamafactory (an environment with LLaMA-Factory 0.9.5 and its pins, "
                              ".venv-lf), or pip install oom-harness into the environment that has LLaMA-Factory"}


def through_trainer(case: Case) -> bool:
    """Whether the case trains through a framework's trainer rather than the harness's own loop."""
    return case.stack in TRAINER_STACKS


def interpreter(case: Case) -> str | None:
    """The Python the case's workers run on: this one, unless its framework is missing here and another
    environment's interpreter is named for it; None where no interpreter at hand has the framework."""
    module = _MODULE.get(case.stack)
    if module is None or importlib.util.find_spec(module) is not None:
        return sys.executable
    return os.environ.get(PYTHON_VARIABLE[case.stack]) or None


def unavailable(case: Case) -> str | None:
    """Why the case's stack cannot run here (None: it can)."""
    py = interpreter(case)
    if py is None:
        return (f"stack {case.stack.value}: {_MODULE[case.stack]} is not installed here and "
                f"{PYTHON_VARIABLE[case.stack]} names no interpreter that has it; make one with {_SETUP[case.stack]}")
    if not os.access(py, os.X_OK):
        return f"stack {case.stack.value}: {PYTHON_VARIABLE[case.stack]}={py} is not an executable file"
    return None


def tiny_schedule(values: dict, shape) -> list[str]:
    """At tiny size, a framework's learning rate held constant (no warm-up, no decay) in its arguments
    `values`: a run of a few steps then shows its loss falling, which the `trains` claim checks; the
    schedule changes no memory. Returns the note the run's record keeps."""
    if shape.fidelity != "tiny":
        return []
    values.pop("warmup_ratio", None)  # not a field of every transformers' TrainingArguments (5.17 has none)
    values.update(lr_scheduler_type="constant", warmup_steps=0)
    return ["tiny size: the learning rate held constant, so a few steps show the loss falling"]
