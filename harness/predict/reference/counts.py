"""The parameter counts the reference estimators take, read off the case's model built on `meta`.

Two builds, as the tools themselves see a model:

* DeepSpeed's estimators take the total parameter count and the largest layer's (the most
  parameters any one module holds directly, `model_to_params` in deepspeed.runtime.zero.stage3) of
  the model that trains: `AutoModelForCausalLM`, the output head included, tied weights counted
  once. DeepSpeed's own `model_to_params` tells shared weights apart by `data_ptr()`, which is 0 for
  every tensor on `meta`; here they are told apart by identity (`Module.parameters()` yields a shared
  weight once), the same count on a real model (tests/test_reference_estimators.py checks it).
* `accelerate estimate-memory` builds `AutoModel` (the base model: no output head) in float32 under
  `init_empty_weights` and sizes it with `accelerate.utils.calculate_maximum_sizes` (parameters and
  buffers, in bytes). The same is done here from the config, without the hub.

The model is the case's as measured: `case.layers` decoder layers where the case sets it (full width,
fewer layers), else the architecture's full depth.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from harness.models.registry import hf_config, truncated_config
from harness.models.source import load_model
from harness.spec.schema import Case


@dataclass(frozen=True)
class ModelCounts:
    """What the estimators read off one model."""

    total_params: int  # parameters of the causal LM, shared ones once
    largest_layer_params: int  # most parameters held directly by one module (DeepSpeed's largest layer)
    accelerate_total_bytes: int  # calculate_maximum_sizes: the base model's tensors in float32
    accelerate_largest_layer_bytes: int  # calculate_maximum_sizes: its largest layer, float32

    @property
    def billions(self) -> float:
        return self.total_params / 1e9


def case_config(case: Case) -> dict:
    """The Hugging Face config of the model as the case measures it."""
    arch = load_model(case.model)
    return truncated_config(arch, case.layers) if case.layers else dict(arch.config)


def model_counts(case: Case) -> ModelCounts:
    return config_counts(case_config(case))


def config_counts(config: dict) -> ModelCounts:
    """The counts of the model a Hugging Face config describes (cached per config)."""
    return _counts(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=32)
def _counts(config_json: str) -> ModelCounts:
    # heavy: torch, accelerate and transformers, only to count a model built on meta
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel, AutoModelForCausalLM

    config = hf_config(json.loads(config_json))
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total = sum(p.numel() for p in lm.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in lm.modules())
    del lm
    with init_empty_weights():  # as accelerate.commands.estimate.create_empty_model builds it
        base = AutoModel.from_config(config, dtype=torch.float32)
    acc_total, (acc_largest, _names) = calculate_maximum_sizes(base)
    return ModelCounts(total_params=total, largest_layer_params=largest,
                       accelerate_total_bytes=int(acc_total), accelerate_largest_layer_bytes=int(acc_largest))

