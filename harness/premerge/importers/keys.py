"""Known keys, kept as data, and the check that names an unknown one.

Known keys that do not change memory are accepted and ignored; a key in none of these lists is an
error naming the key (with the closest known one), so a typo never passes silently. Where a newer
transformers adds a TrainingArguments field, the installed one is asked before a key is called unknown.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.premerge.importers.errors import ConfigError

# Hugging Face transformers TrainingArguments / Seq2SeqTrainingArguments (4.4x-5.x).
HF_TRAINING_KEYS = frozenset("""
output_dir overwrite_output_dir do_train do_eval do_predict eval_strategy evaluation_strategy
prediction_loss_only per_device_train_batch_size per_device_eval_batch_size per_gpu_train_batch_size
per_gpu_eval_batch_size gradient_accumulation_steps eval_accumulation_steps eval_delay
torch_empty_cache_steps learning_rate weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm
num_train_epochs max_steps lr_scheduler_type lr_scheduler_kwargs warmup_ratio warmup_steps log_level
log_level_replica log_on_each_node logging_dir logging_strategy logging_first_step logging_steps
logging_nan_inf_filter save_strategy save_steps save_total_limit save_safetensors save_on_each_node
save_only_model restore_callback_states_from_checkpoint no_cuda use_cpu use_mps_device seed data_seed
jit_mode_eval use_ipex bf16 fp16 fp16_opt_level half_precision_backend bf16_full_eval fp16_full_eval
tf32 local_rank ddp_backend tpu_num_cores tpu_metrics_debug debug dataloader_drop_last eval_steps
dataloader_num_workers dataloader_prefetch_factor past_index run_name disable_tqdm remove_unused_columns
label_names load_best_model_at_end metric_for_best_model greater_is_better ignore_data_skip fsdp
fsdp_min_num_params fsdp_config fsdp_transformer_layer_cls_to_wrap accelerator_config
parallelism_config deepspeed label_smoothing_factor optim optim_args adafactor group_by_length
length_column_name report_to project trackio_space_id ddp_find_unused_parameters ddp_bucket_cap_mb
ddp_broadcast_buffers dataloader_pin_memory dataloader_persistent_workers skip_memory_metrics
use_legacy_prediction_loop push_to_hub resume_from_checkpoint hub_model_id hub_strategy hub_token
hub_private_repo hub_always_push hub_revision gradient_checkpointing gradient_checkpointing_kwargs
include_inputs_for_metrics include_for_metrics eval_do_concat_batches fp16_backend
push_to_hub_model_id push_to_hub_organization push_to_hub_token mp_parameters auto_find_batch_size
full_determinism torchdynamo ray_scope ddp_timeout torch_compile torch_compile_backend
torch_compile_mode include_tokens_per_second include_num_input_tokens_seen neftune_noise_alpha
optim_target_modules batch_eval_metrics eval_on_start use_liger_kernel liger_kernel_config
eval_use_gather_object average_tokens_across_devices sortish_sampler predict_with_generate
generation_max_length generation_num_beams generation_config
""".split())

# LLaMA-Factory's own arguments (model, data, fine-tuning, generation), as of 0.9.x.
LLAMAFACTORY_KEYS = frozenset("""
model_name_or_path adapter_name_or_path adapter_folder cache_dir use_fast_tokenizer resize_vocab
split_special_tokens add_tokens add_special_tokens new_special_tokens model_revision low_cpu_mem_usage
rope_scaling flash_attn shift_attn mixture_of_depths use_unsloth use_unsloth_gc enable_liger_kernel
moe_aux_loss_coef disable_gradient_checkpointing use_reentrant_gc upcast_layernorm
upcast_lmhead_output train_from_scratch infer_backend offload_folder use_cache infer_dtype
hf_hub_token ms_hub_token om_hub_token print_param_status trust_remote_code compute_dtype device_map
model_max_length block_diag_attn quantization_method quantization_bit quantization_type
double_quantization quantization_device_map export_dir export_size export_device
export_quantization_bit export_quantization_dataset export_quantization_nsamples
export_quantization_maxlen export_legacy_format export_hub_model_id image_max_pixels image_min_pixels
image_do_pan_and_scan crop_to_patches video_max_pixels video_min_pixels video_fps video_maxlen
use_audio_in_video audio_sampling_rate vllm_maxlen vllm_gpu_util vllm_enforce_eager
vllm_max_lora_rank vllm_config sglang_maxlen sglang_mem_fraction sglang_tp_size sglang_config
sglang_lora_backend
template dataset eval_dataset dataset_dir media_dir cutoff_len train_on_prompt mask_history streaming
buffer_size mix_strategy interleave_probs overwrite_cache preprocessing_batch_size
preprocessing_num_workers max_samples eval_num_beams ignore_pad_token_for_loss val_size
eval_on_each_dataset packing neat_packing tool_format default_system enable_thinking tokenized_path
data_shared_file_system
freeze_trainable_layers freeze_trainable_modules freeze_extra_modules freeze_multi_modal_projector
freeze_vision_tower freeze_language_model additional_target lora_alpha lora_dropout lora_rank
lora_target loraplus_lr_ratio loraplus_lr_embedding use_rslora use_dora pissa_init pissa_iter
pissa_convert create_new_adapter module_dropout oft_rank oft_block_size oft_target pref_beta pref_ftx
pref_bco_weight pref_loss dpo_label_smoothing kto_chosen_weight kto_rejected_weight simpo_gamma
ppo_buffer_size ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards ref_model ref_model_adapters
ref_model_quantization_bit reward_model reward_model_adapters reward_model_quantization_bit
reward_model_type ld_alpha use_galore galore_target galore_rank galore_update_interval galore_scale
galore_proj_type galore_layerwise use_apollo apollo_target apollo_rank apollo_update_interval
apollo_scale apollo_proj apollo_proj_type apollo_scale_type apollo_layerwise apollo_scale_front
use_badam badam_mode badam_start_block badam_switch_mode badam_switch_interval badam_update_ratio
badam_mask_mode badam_verbose use_swanlab swanlab_project swanlab_workspace swanlab_run_name
swanlab_mode swanlab_api_key swanlab_logdir swanlab_lark_webhook_url swanlab_lark_secret pure_bf16
stage finetuning_type use_llama_pro use_adam_mini use_muon use_mca freeze_vision_tower
compute_accuracy disable_shuffling early_stopping_steps plot_loss include_effective_tokens_per_second
do_sample temperature top_p top_k num_beams max_length max_new_tokens repetition_penalty
length_penalty skip_special_tokens
""".split())

# Training scripts that take TrainingArguments as JSON usually add model, data, LoRA and 4-bit
# fields with these (transformers / TRL SFTConfig / peft LoraConfig / BitsAndBytesConfig) names.
SCRIPT_KEYS = frozenset("""
model_name_or_path data_path dataset_name dataset_config train_file validation_file
trust_remote_code torch_dtype dtype attn_implementation model_max_length max_length max_seq_length
packing padding_free dataset_text_field dataset_num_proc completion_only_loss assistant_only_loss
model_init_kwargs dataset_kwargs eos_token pad_token chat_template_path logits_to_keep
use_peft lora_r lora_rank lora_alpha lora_dropout lora_target_modules lora_target target_modules
load_in_4bit use_4bit load_in_8bit use_8bit bnb_4bit_quant_type bnb_4bit_use_double_quant
bnb_4bit_compute_dtype bnb_4bit_quant_storage
""".split())

# DeepSpeed's top-level config keys and its zero_optimization keys (0.14-0.19).
DEEPSPEED_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping
steps_per_print wall_clock_breakdown dump_state prescale_gradients gradient_predivide_factor
zero_allow_untested_optimizer zero_force_ds_cpu_optimizer fp16 bf16 bfloat16 amp optimizer scheduler
zero_optimization activation_checkpointing flops_profiler tensorboard wandb csv_monitor comet
comms_logger communication_data_type seq_parallel_communication_data_type data_types elasticity aio
autotuning checkpoint compression_training data_efficiency curriculum_learning pipeline
sparse_attention memory_breakdown disable_allgather gradient_accumulation_dtype
load_universal_checkpoint use_data_before_expert_parallelism graph_harvesting compile timers
hybrid_engine torch_autocast nebula sparse_gradients eigenvalue progressive_layer_drop
quantize_training zero_quantized_weights dataloader_drop_last
""".split())

DEEPSPEED_ZERO_KEYS = frozenset("""
stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce
allgather_partitions allgather_bucket_size overlap_comm load_from_fp32_weights elastic_checkpoint
offload_param offload_optimizer sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload
prefetch_bucket_size stage3_prefetch_bucket_size param_persistence_threshold
stage3_param_persistence_threshold model_persistence_threshold stage3_model_persistence_threshold
max_live_parameters stage3_max_live_parameters max_reuse_distance stage3_max_reuse_distance
gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save
stage3_gather_fp16_weights_on_model_save module_granularity_threshold use_all_reduce_for_fetch_params
stage3_use_all_reduce_for_fetch_params ignore_unused_parameters legacy_stage1 round_robin_gradients
zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights
zero_quantized_gradients zeropp_loco_param mics_shard_size mics_hierarchical_params_gather
memory_efficient_linear pipeline_loading_checkpoint override_module_apply log_trace_cache_warnings
""".split())

DEEPSPEED_OFFLOAD_KEYS = frozenset("""
device nvme_path buffer_count buffer_size max_in_cpu pin_memory pipeline_read pipeline_write
fast_init ratio
""".split())

# TrainingArguments' `optim` (transformers' OptimizerNames, 4.4x-5.x) by the state it keeps next to the AdamW
# the predictor models (two fp32 moments per trainable parameter): "modelled" keeps the same; "smaller" keeps
# less (8- or 4-bit moments, one moment or none, paged state that can leave the card, low-rank projected
# state); any other valid name can keep more (a third moment, extra buffers) and leaves the verdict undecided.
HF_OPTIMIZERS = {
    **dict.fromkeys(("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_hf",
                     "adamw_apex_fused"), "modelled"),
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch_4bit",
                     "adamw_torch_8bit", "adafactor", "sgd", "adagrad", "lion_8bit", "lion_32bit", "paged_lion_8bit",
                     "paged_lion_32bit", "rmsprop", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
                     "ademamix_8bit", "paged_ademamix_8bit", "lomo", "adalomo", "galore_adamw", "galore_adamw_8bit",
                     "galore_adafactor", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
                     "galore_adafactor_layerwise", "apollo_adamw", "apollo_adamw_layerwise"), "smaller"),
}

# --- Keys that change memory ---------------------------------------------------------------------
# Each format's memory-relevant keys that the predictor does not model: key -> Unmodelled. The importers
# record one where its value counts (`when`); the check names it and, where it can raise the peak,
# claims no verdict. docs/case-format.md lists these tables and MODELLED_KEYS (harness.premerge.case_format_doc).


@dataclass(frozen=True)
class Unmodelled:
    raises: bool | None  # True: can raise the peak; False: can only lower it; None: depends on the value
    why: str  # what it does to memory
    when: str  # the values that count

    def entry(self, raises: bool | None = None) -> tuple[bool, str]:
        """(raises, why) for one value (`raises` given where the table says it depends)."""
        chosen = self.raises if raises is None else raises
        if chosen is None:
            raise ValueError("this key's effect depends on its value: pass raises")
        return chosen, self.why


LLAMAFACTORY_NOT_MODELLED = {
    "use_dora": Unmodelled(True, "DoRA adds a magnitude vector per adapted module and keeps the weight norm's "
                                 "activations for backward", "true"),
    "pissa_init": Unmodelled(True, "PiSSA initialises adapters from an SVD of each adapted weight (full-size "
                                   "fp32 temporaries at load)", "true"),
    "use_llama_pro": Unmodelled(True, "LLaMA Pro adds and trains new decoder blocks", "true"),
    "additional_target": Unmodelled(True, "modules trained in full beside LoRA: their gradients and optimizer "
                                          "state", "a module list"),
    "mixture_of_depths": Unmodelled(True, "Mixture-of-Depths adds routers and changes which tokens each layer "
                                          "keeps", "convert or load"),
    "upcast_lmhead_output": Unmodelled(True, "the logits are upcast to fp32: a second logits-sized tensor", "true"),
    "upcast_layernorm": Unmodelled(True, "norm weights and their outputs in fp32", "true"),
    "block_diag_attn": Unmodelled(True, "a 4D block-diagonal attention mask per batch (seq_len^2 per sample)",
                                  "true"),
    "neat_packing": Unmodelled(True, "packing with a 4D block-diagonal attention mask (seq_len^2 per sample)",
                               "true"),
    "use_galore": Unmodelled(False, "GaLore keeps the optimizer state in a low-rank projection", "true"),
    "use_apollo": Unmodelled(False, "APOLLO keeps the optimizer state in a low-rank projection", "true"),
    "use_badam": Unmodelled(False, "BAdam trains one block of layers at a time", "true"),
    "use_adam_mini": Unmodelled(False, "Adam-mini keeps one second moment per block, not per parameter", "true"),
    "use_muon": Unmodelled(False, "Muon keeps one momentum for its matrices", "true"),
    "use_unsloth": Unmodelled(False, "Unsloth's kernels keep less for backward", "true"),
    "use_unsloth_gc": Unmodelled(False, "Unsloth's checkpointing offloads the checkpoints to the host", "true"),
    "shift_attn": Unmodelled(False, "shift short attention (S^2-Attn) attends within groups", "true"),
}

# TrainingArguments fields (both training formats: LLaMA-Factory passes every one through).
HF_NOT_MODELLED = {
    "optim": Unmodelled(None, "the optimizer's state: the AdamW modelled (adamw_torch, adamw_torch_fused) keeps "
                              "two fp32 moments per trainable parameter; 8-bit, 4-bit, paged, one-moment and "
                              "low-rank ones (adamw_bnb_8bit, paged_adamw_8bit, adafactor, lion_*, sgd, galore_*) "
                              "keep less, so they can only lower the peak; others (ademamix, grokadamw, "
                              "schedule_free_*) can raise it", "any optimizer but that AdamW"),
    "adafactor": Unmodelled(False, "Adafactor keeps factored second moments, far less than AdamW", "true"),
    "per_device_eval_batch_size": Unmodelled(True, "evaluation forwards at a batch above the training micro "
                                                   "batch: their logits are not predicted",
                                             "above the micro batch, with evaluation on (default 8)"),
    "label_smoothing_factor": Unmodelled(True, "the Trainer's label smoother takes a log-softmax of the logits "
                                               "outside the model, a logits-sized tensor more", "above 0"),
    "torch_compile": Unmodelled(True, "torch.compile changes what the forward keeps for backward and adds "
                                      "buffers of its own", "true"),
    "auto_find_batch_size": Unmodelled(False, "the Trainer halves the batch after an out-of-memory error; the "
                                              "prediction is for the batch as written", "true"),
    "torch_empty_cache_steps": Unmodelled(False, "emptying the cache returns cached blocks: reserved can only "
                                                 "fall", "set"),
}

# Fields training scripts add to a TrainingArguments JSON (SCRIPT_KEYS).
SCRIPT_NOT_MODELLED = {
    "torch_dtype": Unmodelled(None, "the dtype the weights are loaded in: float32 under bf16 or fp16 training "
                                    "can raise the peak, a narrower one only lower it",
                              "a dtype other than the precision predicted"),
    "dtype": Unmodelled(None, "as torch_dtype (its newer name)", "a dtype other than the precision predicted"),
    "model_init_kwargs": Unmodelled(True, "arguments to from_pretrained (dtype, quantization, attention) beyond "
                                          "the keys read", "not empty"),
}

# DeepSpeed JSON, by the key's dotted path in the file.
DEEPSPEED_NOT_MODELLED = {
    "zero_optimization.offload_optimizer.ratio": Unmodelled(
        True, "a partial offload: the optimizer's fp32 state and step for the rest stay on the card; predicted "
              "as a full offload", "below 1, with an offload device"),
    "zero_optimization.zero_hpz_partition_size": Unmodelled(
        True, "ZeRO++ hpZ keeps a second copy of the 16-bit parameters, partitioned within a node",
        "above 1, under stage 3"),
    "zero_optimization.zero_quantized_weights": Unmodelled(
        True, "ZeRO++ qwZ: int8 copies of the parameters and quantization buffers for every all-gather", "true"),
    "zero_optimization.zero_quantized_gradients": Unmodelled(
        True, "ZeRO++ qgZ: quantized gradient all-to-all buffers", "true"),
    "zero_optimization.zero_quantized_nontrainable_weights": Unmodelled(
        False, "frozen weights kept in int8", "true"),
    "zero_optimization.mics_shard_size": Unmodelled(
        True, "MiCS partitions the model states over groups of ranks, not the whole world: each rank holds "
              "more of them", "above 0"),
    "optimizer.type": Unmodelled(
        None, "DeepSpeed's own optimizer: Adam and AdamW (FusedAdam, CPUAdam, MuAdam, MuAdamW) keep what is "
              "modelled; Lion, Adagrad and SGD keep less, so they can only lower the peak; other types (Lamb, "
              "OneBitAdam, ZeroOneAdam, ...) can raise it", "a type other than Adam or AdamW"),
    "data_types.grad_accum_dtype": Unmodelled(True, "gradients accumulated in a dtype of its own", "set"),
    "communication_data_type": Unmodelled(True, "reduction buffers in a dtype of their own", "set"),
}

# Keys that change memory and are modelled, by format: key -> what of the case it sets (the doc's table).
MODELLED_KEYS = {
    "LLaMA-Factory YAML": {
        "model_name_or_path": "`model`: a registry name, a hub id the registry knows, or a folder with config.json",
        "stage": "sft and pt (reward, PPO, DPO, KTO refused)",
        "finetuning_type": "`method.kind`: lora or full (freeze and OFT refused)",
        "lora_rank, lora_alpha, lora_dropout, lora_target": "`method.lora` (targets checked against the model)",
        "quantization_bit, quantization_method, quantization_type, double_quantization":
            "`method.quantization`: 4-bit bitsandbytes (other widths refused)",
        "cutoff_len": "`train.seq_len`",
        "disable_gradient_checkpointing, gradient_checkpointing": "`train.gradient_checkpointing` (on by default)",
        "use_reentrant_gc": "`train.checkpointing_reentrant` (true by default)",
        "flash_attn": "`train.attn_implementation`",
        "bf16, fp16, pure_bf16": "`precision`",
        "deepspeed": "the `deepspeed` block, read from the DeepSpeed JSON",
        "enable_liger_kernel": "`train.liger_kernel`: the fused linear cross-entropy keeps no logits (the trace runs "
                               "a stand-in of Liger's kernel); its RMSNorm, SwiGLU and RoPE kernels are traced as "
                               "transformers' own ops",
    },
    "TrainingArguments (both training formats)": {
        "per_device_train_batch_size": "`train.micro_batch`",
        "gradient_accumulation_steps": "`train.grad_accum`",
        "gradient_checkpointing": "`train.gradient_checkpointing`",
        "gradient_checkpointing_kwargs.use_reentrant": "`train.checkpointing_reentrant`",
        "bf16, fp16": "`precision` (neither: the model's dtype)",
        "dataloader_num_workers, dataloader_prefetch_factor, dataloader_pin_memory": "`train` (host RAM)",
        "deepspeed": "the `deepspeed` block, read from the DeepSpeed JSON (a path or inline)",
        "fsdp, fsdp_config": "refused: FSDP is not modelled",
        "use_liger_kernel": "`train.liger_kernel`, as enable_liger_kernel",
        "optim": "`train.optim` for adamw_torch (foreach) and adamw_torch_fused (the default); others named as "
                 "not modelled",
    },
    "TrainingArguments JSON: script fields": {
        "model_name_or_path": "`model`",
        "max_length, max_seq_length, model_max_length": "`train.seq_len`",
        "lora_r, lora_rank, lora_alpha, lora_dropout, lora_target_modules, target_modules, use_peft":
            "`method.lora` (targets checked against the model)",
        "load_in_4bit, use_4bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype":
            "`method.quantization`",
        "load_in_8bit, use_8bit": "refused: 8-bit weights are not modelled",
        "attn_implementation": "`train.attn_implementation`",
        "logits_to_keep": "`train.logits_to_keep`",
    },
    "DeepSpeed JSON": {
        "zero_optimization.stage": "`deepspeed.stage`",
        "zero_optimization.offload_optimizer.device, offload_param.device, cpu_offload":
            "`deepspeed.offload_optimizer`, `deepspeed.offload_param` (NVMe refused)",
        "zero_optimization.offload_*.pin_memory": "`deepspeed.pin_memory` (host RAM)",
        "zero_optimization.overlap_comm, contiguous_gradients": "`deepspeed` block",
        "zero_optimization.reduce_bucket_size, allgather_bucket_size, sub_group_size, stage3_*":
            "`deepspeed` block (\"auto\" resolved as transformers resolves it)",
        "train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size":
            "checked against the training config (a lint)",
        "fp16.enabled, bf16.enabled, activation_checkpointing": "checked against the training config (lints)",
    },
}

# DeepSpeed's optimizer `type`s (lowercase, no '_'; deepspeed/runtime/config.py) by their state next to the
# Adam the predictor models: "modelled" (Adam's two fp32 moments), "smaller" (one moment or none); any other
# type is taken as one that can hold more.
DEEPSPEED_OPTIMIZERS = {
    "adam": "modelled", "adamw": "modelled", "fusedadam": "modelled", "cpuadam": "modelled",
    "deepspeedcpuadam": "modelled", "muadam": "modelled", "muadamw": "modelled",
    "lion": "smaller", "deepspeedcpulion": "smaller", "adagrad": "smaller", "deepspeedcpuadagrad": "smaller",
    "musgd": "smaller", "sgd": "smaller",
}

# The stage-3 keys DeepSpeed also accepts without their `stage3_` prefix.
DEEPSPEED_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
}

# What DeepSpeed uses where a config leaves a key out (deepspeed/runtime/zero/config.py).
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}


def check_keys(path: Path, data: dict[str, Any], known: frozenset[str], prefix: str = "",
               training_fields: bool = False) -> None:
    """Every key of `data` is in `known`; with `training_fields`, also a TrainingArguments field of the
    installed transformers (for fields newer than HF_TRAINING_KEYS)."""
    unknown = [k for k in data if k not in known]
    if training_fields and any(isinstance(k, str) and k.isidentifier() for k in unknown):
        unknown = [k for k in unknown if k not in installed_training_fields()]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
        fix = (f"did you mean '{close[0]}'?" if close
               else "remove it, or check the spelling against the tool's documentation")
        more = f" (and {len(unknown) - 1} more: {', '.join(map(str, unknown[1:4]))})" if len(unknown) > 1 else ""
        raise ConfigError(path, prefix + str(key), f"unknown key{more}", fix)


def installed_training_fields() -> frozenset[str]:
    """TrainingArguments fields of the installed transformers, for fields newer than the list here.
    Asked only when a key is not in the list (importing transformers takes seconds)."""
    import dataclasses
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # optional kernels announce themselves while transformers imports
    try:
        from transformers import Seq2SeqTrainingArguments

        return frozenset(f.name for f in dataclasses.fields(Seq2SeqTrainingArguments))
    except Exception:  # no transformers, or one that fails to import: the list alone decides
        return frozenset()
    finally:
        logging.disable(previous)
