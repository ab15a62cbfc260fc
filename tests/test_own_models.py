"""A case's model may be any causal LM given by a Hugging Face config.json folder: the tiny rule
shrinks it keeping its family's structure, it builds and trains a step, and the predictor sizes it."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from harness.models.registry import TINY_HEAD_DIM, TINY_VOCAB, Architecture, hf_config, tiny_config
from harness.models.source import load_model, model_label
from harness.runtime.build import model_config_dict
from harness.spec.cases import CASES_DIR, CaseError, load_case
from harness.spec.shape import run_shape
from harness.spec.variants import parse_variant

DATA = Path(__file__).parent / "data"
LLAMA_DIR = DATA / "llama-3.1-8b"

# Published configs' shape keys (the rest of each config.json does not change the shapes).
FAMILIES = {
    "mistral-7b-v0.3": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "vocab_size": 32768, "max_position_embeddings": 32768, "rope_theta": 1e6,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
        "max_position_embeddings": 131072, "sliding_window": 131072, "max_window_layers": 28,
        "use_sliding_window": False, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643},
    "phi-3-mini-128k": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000},
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336,
        "vocab_size": 256000, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840,
        "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001},
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "intermediate_size": 6912, "vocab_size": 262144, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106]},
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2-57b-a14b": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 3584,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
        "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "num_experts": 64,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "vocab_size": 151936, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643},
}


def _arch(name: str) -> Architecture:
    return Architecture(name=name, source="test", config=copy.deepcopy(FAMILIES[name]))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_rule_keeps_each_familys_structure(name):
    full = FAMILIES[name]
    tiny = tiny_config(_arch(name), 64)
    assert tiny["model_type"] == full["model_type"] and tiny["vocab_size"] == TINY_VOCAB
    assert tiny["hidden_size"] < full["hidden_size"] and tiny["num_hidden_layers"] == 2
    assert (tiny["num_attention_heads"] // tiny["num_key_value_heads"]
            == full["num_attention_heads"] // full["num_key_value_heads"])  # GQA ratio kept
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in full:  # every MLP width keeps its ratio to the hidden size
            assert tiny[key] / tiny["hidden_size"] == pytest.approx(full[key] / full["hidden_size"], rel=0.15)
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "tie_word_embeddings"):
        assert tiny.get(key) == full.get(key)  # experts and routing as published
    if "head_dim" in full:
        assert tiny["head_dim"] == TINY_HEAD_DIM
    if full.get("sliding_window"):
        assert tiny["sliding_window"] <= 32  # the window slides at the tiny length
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(tiny.get(key), int):
            assert 0 <= tiny[key] < TINY_VOCAB


def test_gemma2_keeps_its_attention_wider_than_the_hidden_size():
    full, tiny = FAMILIES["gemma-2-9b"], tiny_config(_arch("gemma-2-9b"), 64)
    assert tiny["head_dim"] * tiny["num_attention_heads"] / tiny["hidden_size"] == pytest.approx(
        full["head_dim"] * full["num_attention_heads"] / full["hidden_size"], rel=0.1)
    assert tiny["query_pre_attn_scalar"] == TINY_HEAD_DIM  # 256 / 256 of the head size, as published


@pytest.mark.parametrize("name", ["gemma-2-9b", "gemma-3-1b"])
def test_tiny_models_keep_both_sliding_and_global_attention(name):
    hf = hf_config(tiny_config(_arch(name), 64))
    assert set(hf.layer_types) == {"sliding_attention", "full_attention"}


def test_phi3_longrope_keeps_one_factor_per_tiny_frequency():
    tiny = tiny_config(_arch("phi-3-mini-128k"), 64)
    head_dim = tiny["hidden_size"] // tiny["num_attention_heads"]
    assert len(tiny["rope_scaling"]["short_factor"]) == len(tiny["rope_scaling"]["long_factor"]) == head_dim // 2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_models_of_every_family_build_and_train_a_step(name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(tiny_config(_arch(name), 32)))
    assert type(model).__name__ == FAMILIES[name]["architectures"][0]
    ids = torch.randint(0, TINY_VOCAB, (2, 32))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and out.logits.shape == (2, 32, TINY_VOCAB)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.dim() == 2)


def _case_data(model: str) -> dict:
    data = yaml.safe_load((CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml").read_text())
    data.pop("guide")
    data.update(id="llama-lora", model=model, claims=[{"kind": "trains"}],
                source={"title": "the team's nightly SFT config"},
                method={"kind": "lora", "lora": {"r": 16, "alpha": 32, "targets": "all"}}, stack="plain")
    return data


def _write_case(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{data['id']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture()
def team_repo(tmp_path) -> Path:
    """A team's repository: its cases in cases/, its model's config.json in models/llama-3.1-8b/."""
    shutil.copytree(LLAMA_DIR, tmp_path / "models" / "llama-3.1-8b")
    return tmp_path


def test_a_config_json_folder_relative_to_the_case_file_loads(team_repo, monkeypatch):
    path = _write_case(team_repo / "cases", _case_data("../models/llama-3.1-8b"))
    monkeypatch.chdir(team_repo / "cases" / "..")  # the working directory does not matter
    case = load_case(path)
    assert Path(case.model) == (team_repo / "models" / "llama-3.1-8b").resolve()
    arch = load_model(case.model)
    assert (arch.layers, arch.config["num_key_value_heads"], arch.config["vocab_size"]) == (32, 8, 128256)
    assert model_label(case.model) == "llama-3.1-8b"
    # an absolute folder works as well, and the loaded case revalidates in another process unchanged
    again = load_case(_write_case(team_repo / "elsewhere", _case_data(str(team_repo / "models" / "llama-3.1-8b"))))
    assert again.model == case.model


def test_a_missing_model_folder_names_the_file_the_field_and_the_fix(team_repo):
    path = _write_case(team_repo / "cases", _case_data("../models/llama-3.2-1b"))
    with pytest.raises(CaseError) as info:
        load_case(path)
    text = str(info.value)
    assert str(path) in text and "model:" in text and "config.json" in text
    (team_repo / "models" / "empty").mkdir()
    with pytest.raises(CaseError, match=r"no config\.json"):
        load_case(_write_case(team_repo / "cases", _case_data("../models/empty")))


def test_a_config_json_case_shrinks_and_builds_at_tiny_size(team_repo):
    case = load_case(_write_case(team_repo / "cases", _case_data("../models/llama-3.1-8b")))
    shape = run_shape(case, "tiny")
    cfg = model_config_dict(case, "tiny", shape.seq_len)
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == shape.hidden_size < 4096
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 4  # Llama 3's 32:8
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert model_config_dict(case, "real", case.train.seq_len, layers=4)["num_hidden_layers"] == 4
    variant = parse_variant("4L")
    assert variant.label(case) == "4 of 32 layers" and variant.apply(case).layers == 4


def test_layers_beyond_the_folders_depth_are_rejected(team_repo):
    data = dict(_case_data("../models/llama-3.1-8b"), layers=40)
    with pytest.raises(CaseError, match="layers 40 exceeds the model's 32 layers"):
        load_case(_write_case(team_repo / "cases", data))


def test_the_predictor_sizes_a_config_json_case(team_repo):
    from harness.predict.predictor import predict

    case = load_case(_write_case(team_repo / "cases", _case_data("../models/llama-3.1-8b")))
    p = predict(case)
    # 8.03 B parameters of Llama-3.1-8B, held in bf16 by a LoRA job: at least 15 GiB of weights
    assert p.params_total == pytest.approx(8.03e9, rel=0.01)
    assert p.device > 15 * 2**30 and p.allocated <= p.reserved < p.device
    longer = predict(case.model_copy(update={"train": case.train.model_copy(update={"seq_len": 4096})}))
    assert longer.allocated > p.allocated
    with open(Path(case.model) / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 32  # the folder is read, never written


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen2-57b-a14b", "deepseek-v2-lite"])
def test_model_flops_count_the_experts_a_token_is_routed_to(name):
    from transformers import AutoModelForCausalLM

    from harness.measure.flops import linear_weight_count

    cfg = tiny_config(_arch(name), 32)
    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
    stacked = sum(p.numel() for p in model.parameters() if p.dim() == 3 and p.shape[0] == experts)
    assert stacked > 0  # the experts' projections are 3-D parameters, not nn.Linear
    dense = linear_weight_count(model)
    assert linear_weight_count(model, cfg) == dense + stacked * cfg["num_experts_per_tok"] // experts
    assert linear_weight_count(model, FAMILIES["mistral-7b-v0.3"]) == dense  # no experts in the config: unchanged


def test_the_architecture_benchmark_covers_unseen_models_and_its_baselines_match_its_cases():
    """benchmarks/architectures: every case loads, its model is a config.json folder of a model no
    bundled case trains, at least six architectures and a mixture of experts; every blessed baseline
    belongs to one of its cases, as measured (variant applied), and trained."""
    from harness.baselines.store import load_baselines
    from harness.spec.suite import ARCH_BASELINES_DIR, ARCH_CASES_DIR

    cases = {p.stem: load_case(p) for p in sorted(ARCH_CASES_DIR.glob("*.yaml"))}
    assert cases and all(c.id == cid for cid, c in cases.items())
    models = {cid: load_model(c.model) for cid, c in cases.items()}
    bundled = {load_case(p).model for p in CASES_DIR.glob("*.yaml")}
    assert not {Path(c.model).name for c in cases.values()} & bundled
    assert len({m.config["model_type"] for m in models.values()}) >= 6
    assert any("num_experts" in m.config or "num_local_experts" in m.config for m in models.values())
    kinds = {(c.method.kind, c.deepspeed.stage if c.deepspeed else 0) for c in cases.values()}
    assert {("lora", 0), ("qlora", 0), ("full", 0), ("lora", 2), ("lora", 3), ("full", 3)} <= kinds
    baselines = load_baselines(ARCH_BASELINES_DIR)
    assert len(baselines) >= 15
    for b in baselines:
        measured = b.case_as_measured(cases[b.case_id])
        assert b.platform.device_count == measured.launch.ranks
        assert all(r.outcome == "ok" for r in b.runs), b.case_id


def test_fits_verified_configs_are_cases_of_what_fit_wrote_and_their_baselines_are_in_the_errors():
    """benchmarks/fitted: each case is what `fit --verify` ran (written by case-from, with the
    prediction it was written with, beside the config fit wrote), each has a baseline that trained,
    and the error table the margins are drawn from holds every one of them."""
    from harness.baselines.store import load_baselines
    from harness.predict.margin import ERRORS_FILE, ErrorTable, inputs_digest
    from harness.spec.suite import FITTED_BASELINES_DIR, FITTED_CASES_DIR

    cases = {p.stem: load_case(p) for p in sorted(FITTED_CASES_DIR.glob("*.yaml"))}
    assert cases and all(cid.endswith(".fitted") and c.predicted is not None for cid, c in cases.items())
    for c in cases.values():
        assert (FITTED_CASES_DIR / c.source.config).resolve().is_file()  # the config fit wrote, kept beside
    baselines = load_baselines(FITTED_BASELINES_DIR)
    assert {b.case_id for b in baselines} == set(cases)
    for b in baselines:
        measured = b.case_as_measured(cases[b.case_id])
        assert b.platform.device_count == measured.launch.ranks
        assert all(r.outcome == "ok" for r in b.runs), b.case_id
    table = ErrorTable.read(ERRORS_FILE)
    assert table.digest == inputs_digest()  # the fitted suite's files are among what the table depends on
    assert {b.case_id for b in baselines} <= {r.case_id for r in table.records}


@pytest.mark.parametrize("attn", [None, "eager"])
def test_the_worker_builds_the_model_with_the_cases_attention_kernel(team_repo, attn):
    """train.attn_implementation reaches from_config; without it transformers picks (Llama: SDPA)."""
    from harness.runtime.build import build_model

    data = _case_data("../models/llama-3.1-8b")
    data["train"]["gradient_checkpointing"] = False
    if attn is not None:
        data["train"]["attn_implementation"] = attn
    case = load_case(_write_case(team_repo / "cases", data))
    built = build_model(case, "tiny", torch.device("cpu"), None, 64)
    assert built.model.config._attn_implementation == (attn or "sdpa")
