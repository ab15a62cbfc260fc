"""The reference estimators (harness.predict.reference) give what DeepSpeed's estimators, accelerate's
estimate-memory and LLaMA-Factory's table give for a case: checked against the formulas in the
installed packages' sources and the table's cells, from the models' parameter counts worked out by
hand. Models are built on `meta` (no weights): seconds."""

from __future__ import annotations

import io
import json
import re
from argparse import Namespace
from contextlib import redirect_stdout

import pytest

from harness.models.registry import hf_config, load_architecture, tiny_config
from harness.predict.reference import estimator_errors, reference_estimates
from harness.predict.reference.counts import config_counts, model_counts
from harness.predict.reference.llamafactory_table import GB, TABLE, row_for
from harness.spec.schema import Case

# Qwen1.5-0.5B-Chat (harness/models/architectures/qwen1.5-0.5b-chat.json): hidden 1024, 24 layers,
# 16 heads of 64 (as many key-value heads), MLP 2816, vocabulary 151936, tied embeddings, q/k/v biases.
H, LAYERS, FFN, V = 1024, 24, 2816, 151936
ATTENTION = 4 * H * H + 3 * H  # q, k, v, o weights; q, k, v biases
MLP = 3 * H * FFN  # gate, up, down
PER_LAYER = ATTENTION + MLP + 2 * H  # and two RMSNorm weights
EMBED = V * H
N = EMBED + LAYERS * PER_LAYER + H  # tied head counted once; the final norm
LARGEST = EMBED  # the one module holding the most parameters itself
ROTARY_BUFFERS = 2 * (H // 16 // 2)  # inv_freq and original_inv_freq: head_dim / 2 floats each


def make(method: str = "lora", deepspeed: dict | None = None, ranks: int = 1, precision: str = "bf16",
         model: str = "qwen1.5-0.5b-chat", **extra) -> Case:
    methods = {
        "lora": {"kind": "lora", "lora": {"r": 8, "alpha": 16, "targets": "all"}},
        "qlora": {"kind": "qlora", "lora": {"r": 8, "alpha": 16, "targets": "all"}, "quantization": {"bits": 4}},
        "full": {"kind": "full"},
    }
    data = {
        "id": "ref", "family": "ref", "title": "reference estimators", "role": "config", "model": model,
        "precision": precision, "method": methods[method],
        "train": {"micro_batch": 1, "grad_accum": 1, "seq_len": 512},
        "launch": {"launcher": "deepspeed" if deepspeed else "python", "ranks": ranks},
        "target": {"card": {"vendor": "nvidia", "name": "H100", "memory": "80 GiB", "count": max(ranks, 1)}},
        "expect": {"outcome": "fits"},
        **extra,
    }
    if deepspeed:
        data["deepspeed"] = deepspeed
    return Case.model_validate(data)


def by_name(case: Case) -> dict:
    return {e.estimator: e for e in reference_estimates(case)}


def test_parameter_counts_are_the_models():
    counts = model_counts(make())
    assert counts.total_params == N
    assert counts.largest_layer_params == LARGEST
    # accelerate sizes AutoModel in float32, buffers included (tied: the head adds nothing)
    assert counts.accelerate_total_bytes == 4 * (N + ROTARY_BUFFERS)


def test_a_config_json_folder_counts_as_its_registry_twin(tmp_path):
    config = dict(load_architecture("qwen1.5-0.5b-chat").config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_folder = {e.estimator: e.per_card for e in reference_estimates(make(model=str(tmp_path)))}
    assert from_folder == {e.estimator: e.per_card for e in reference_estimates(make())}
    assert from_folder["deepspeed"] == 20 * N


def test_case_layers_shrink_the_model_it_counts():
    assert model_counts(make(layers=12)).total_params == EMBED + 12 * PER_LAYER + H


@pytest.mark.parametrize("name", ["qwen1.5-0.5b-chat", "qwen1.5-7b-chat"])
def test_meta_counts_equal_deepspeeds_own_count_of_a_real_model(name):
    """DeepSpeed's model_to_params tells shared weights apart by data_ptr (0 on meta); on a real model
    (the tiny config: tied and untied heads) the meta count must agree with it."""
    import torch
    from deepspeed.runtime.zero.stage3 import model_to_params
    from transformers import AutoModelForCausalLM

    config = tiny_config(load_architecture(name), 64)
    real = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.float32)
    counts = config_counts(config)
    assert (counts.total_params, counts.largest_layer_params) == model_to_params(real)


def test_deepspeed_zero3_one_gpu_no_offload_is_18_bytes_per_parameter_plus_the_largest_layer():
    # deepspeed/runtime/zero/stage3.py: gpu_mem = 4 * largest_layer_params + int(18 * total_params / total_gpus)
    est = by_name(make(deepspeed={"stage": 3}))["deepspeed"]
    assert est.per_card == 18 * N + 4 * LARGEST
    assert "every parameter counted as trainable" in est.counts


def test_deepspeed_follows_the_cases_zero_config():
    offload = {"offload_optimizer": "cpu", "offload_param": "cpu"}
    assert by_name(make(deepspeed={"stage": 3, **offload}, ranks=2))["deepspeed"].per_card == 4 * LARGEST
    assert by_name(make(deepspeed={"stage": 3, "offload_optimizer": "cpu"}, ranks=2))["deepspeed"].per_card == (
        4 * LARGEST + 2 * N // 2)
    # stage_1_and_2.py: gpu_mem = 2 * total_params + int(18 * total_params / total_gpus); offload: 2 * total_params
    assert by_name(make(deepspeed={"stage": 2}, ranks=4))["deepspeed"].per_card == 2 * N + 18 * N // 4
    assert by_name(make(deepspeed={"stage": 2, "offload_optimizer": "cpu"}, ranks=4))["deepspeed"].per_card == 2 * N
    # no DeepSpeed: ZeRO-2's math on one GPU, nothing partitioned
    assert by_name(make())["deepspeed"].per_card == 20 * N


def test_deepspeed_sees_full_lora_and_qlora_alike():
    z2 = {"stage": 2}
    figures = {m: by_name(make(m, deepspeed=z2, ranks=2))["deepspeed"].per_card for m in ("full", "lora", "qlora")}
    assert len(set(figures.values())) == 1, figures


def test_deepspeed_figure_is_the_row_its_all_cold_printer_prints():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    est = by_name(make(deepspeed={"stage": 3, "offload_optimizer": "cpu"}, ranks=2))["deepspeed"]
    out = io.StringIO()
    with redirect_stdout(out):
        estimate_zero3_model_states_mem_needs_all_cold(N, LARGEST, num_gpus_per_node=2, num_nodes=1)
    # the row of parameters on the GPU, the optimizer offloaded ("offload_optimizer=cpu", spelled by
    # the enum's format, which differs between Python versions), built under zero.Init
    row = next(line for line in out.getvalue().splitlines()
               if "offload_param=none" in line and "offload_optimizer=none" not in line and "zero_init=1" in line)
    printed_gb = float(re.findall(r"([0-9.]+)GB", row)[1])  # per CPU | per GPU
    assert printed_gb == pytest.approx(est.per_card / 2**30, abs=0.005)


def test_accelerate_is_its_training_figure_of_the_base_model():
    # estimate_training_usage: mixed precision -> max(model 4 B, gradients 6 B, optimizer 8 B, step 8 B) per param
    assert by_name(make())["accelerate"].per_card == 8 * (N + ROTARY_BUFFERS)
    # float32 -> max(4, 4, 8, 16)
    assert by_name(make(precision="fp32"))["accelerate"].per_card == 16 * (N + ROTARY_BUFFERS)


def test_accelerate_leaves_an_untied_head_out_as_its_command_does(monkeypatch):
    """`accelerate estimate-memory` itself (gather_data), its hub model swapped for the same config
    built offline the way create_empty_model builds it, prints the figure the estimator gives."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.commands import estimate as acc
    from transformers import AutoModel

    arch = load_architecture("qwen1.5-7b-chat")
    assert arch.config["tie_word_embeddings"] is False

    def offline_model(model_name, library_name, trust_remote_code=False, access_token=None):
        with init_empty_weights():
            return AutoModel.from_config(hf_config(arch.config), dtype=torch.float32)

    monkeypatch.setattr(acc, "create_empty_model", offline_model)
    rows = acc.gather_data(Namespace(model_name="qwen1.5-7b-chat", library_name="transformers",
                                     trust_remote_code=False, dtypes=["float16"]))
    printed = max(rows[0][3].values())
    case = make(model="qwen1.5-7b-chat", precision="fp16")
    est = by_name(case)["accelerate"]
    assert est.per_card == printed
    cfg = arch.config
    head = cfg["vocab_size"] * cfg["hidden_size"]
    rotary = 2 * (cfg["hidden_size"] // cfg["num_attention_heads"] // 2)
    assert est.per_card == 8 * (model_counts(case).total_params - head + rotary)


def test_llamafactory_table_at_its_columns_is_its_cells():
    lora = row_for(make("lora"))
    assert lora.gb_at(7) == 16 and lora.gb_at(70) == 160
    assert row_for(make("full", deepspeed={"stage": 3})).gb_at(7) == 120  # Full (bf16 or fp16), 32 bits
    assert row_for(make("full")).gb_at(7) == 60  # Full (pure_bf16): weights and AdamW state in bf16
    assert row_for(make("qlora")).gb_at(7) == 6
    assert row_for(make("full", precision="fp32")).bits == 32
    assert {(r.method, r.bits) for r in TABLE} >= {("QLoRA", 8), ("QLoRA", 2)}


def test_llamafactory_between_and_beyond_the_columns():
    lora = row_for(make("lora"))
    assert lora.gb_at(10.5) == pytest.approx((16 + 32) / 2)
    assert lora.gb_at(3.5) == pytest.approx(16 / 2)  # linear to zero below the smallest column
    assert lora.gb_at(140) == pytest.approx(2 * 160)  # in proportion above the largest
    est = by_name(make("lora"))["llamafactory"]
    assert est.per_card == round(16 / 7 * N / 1e9 * GB)


def test_llamafactory_is_per_job_not_divided_over_ranks():
    one = by_name(make("lora", deepspeed={"stage": 3}, ranks=1))["llamafactory"].per_card
    four = by_name(make("lora", deepspeed={"stage": 3}, ranks=4))["llamafactory"].per_card
    assert one == four


def test_jobs_sharing_a_card_multiply_every_estimate():
    single = by_name(make())
    shared = by_name(make(launch={"launcher": "python", "ranks": 1, "procs_per_card": 2}))
    assert {k: 2 * e.per_card for k, e in single.items()} == {k: e.per_card for k, e in shared.items()}


def test_errors_give_each_estimators_median_and_worst():
    z3 = make(deepspeed={"stage": 3})
    plain = make()
    ds_z3, ds_plain = by_name(z3)["deepspeed"].per_card, by_name(plain)["deepspeed"].per_card
    summaries = estimator_errors([(z3, ds_z3), (plain, ds_plain // 2)])
    assert list(summaries) == ["deepspeed", "accelerate", "llamafactory"]
    ds = summaries["deepspeed"]
    assert [round(r.error, 6) for r in ds.runs] == [0.0, 1.0]
    assert ds.median == pytest.approx(0.5)
    assert ds.worst.error == pytest.approx(1.0) and ds.under == 0
    lf = summaries["llamafactory"]
    assert lf.worst.error == pytest.approx(lf.worst.estimate / lf.worst.measured - 1)
    with pytest.raises(ValueError, match="case ref: the measured per-card peak"):
        estimator_errors([(plain, 0)])
