"""Model and cluster presets of the planner: shapes and hardware figures, each with the
assumptions it rests on (printed with every plan)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    config: dict[str, Any]  # config.json fields the planner reads
    weights_dtype: str  # dense (non-expert) weights
    expert_weights_dtype: str  # routed experts
    kv_dtype: str
    note: str = ""


def _deepseek_v32() -> dict[str, Any]:
    return dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
        first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, index_topk=2048, index_head_dim=128,
        index_n_heads=64, max_position_embeddings=163840, num_nextn_predict_layers=1,
        tie_word_embeddings=False, torch_dtype="bfloat16")


def _glm5_dsa() -> dict[str, Any]:
    # transformers' GlmMoeDsaConfig defaults (the GLM-5 shape).
    return dict(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
        vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
        first_k_dense_replace=3, q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=192, v_head_dim=256, index_topk=2048, index_head_dim=128,
        index_n_heads=32, max_position_embeddings=202752, num_nextn_predict_layers=1,
        tie_word_embeddings=False, torch_dtype="bfloat16")


def _qwen3_next_80b() -> dict[str, Any]:
    return dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)],
        max_position_embeddings=262144, tie_word_embeddings=False, torch_dtype="bfloat16")


def _gpt_oss_120b() -> dict[str, Any]:
    return dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss",
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
        num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(36)],
        max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16")


def _deepseek_v4_flash() -> dict[str, Any]:
    # DeepSeek-V4-Flash's published config.json (the legacy keys vLLM's V4 reads). Its 44
    # compress_ratios are the 43 decoder layers' (2 sliding-window only, then CSA / HCA
    # alternating: 21 CSA, 20 HCA) and the MTP layer's trailing 0.
    return dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
        num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8,
        sliding_window=128, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
        index_topk=512, index_n_heads=64, index_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=3, hc_mult=4,
        max_position_embeddings=1048576, num_nextn_predict_layers=1, expert_dtype="fp4",
        tie_word_embeddings=False, torch_dtype="bfloat16")


MODEL_PRESETS: dict[str, ModelPreset] = {
    "deepseek-v3.2": ModelPreset(
        _deepseek_v32(), "fp8", "fp8", "fp8",
        "DeepSeek-V3.2 (-Exp) config.json shapes, FP8 checkpoint; the MTP layer is not "
        "loaded (no speculative decoding)"),
    "glm-5-dsa": ModelPreset(
        _glm5_dsa(), "fp8", "fp8", "fp8",
        "GLM-5-DSA-like: transformers' GlmMoeDsaConfig defaults (78 layers, hidden 6144, "
        "256 experts, ~744B params); assumed: an indexer on every layer, DeepSeek-V3.2's "
        "cache formats (MLA row 512+64 -> fp8_ds_mla 656 B, indexer 128 fp8 + 4 B scale), "
        "FP8 weights, MTP layer not loaded"),
    "deepseek-v4-flash": ModelPreset(
        _deepseek_v4_flash(), "fp8", "mxfp4", "fp8",
        "DeepSeek-V4-Flash config.json shapes (284B params: 43 layers = 2 sliding-window only + "
        "21 CSA + 20 HCA, hidden 4096, 256 experts); FP8 weights with MXFP4 routed experts "
        "(vLLM's DeepseekV4FP8Config, expert_dtype fp4); the MTP layer is not loaded (no "
        "speculative decoding)"),
    "qwen3-next-80b": ModelPreset(
        _qwen3_next_80b(), "bf16", "bf16", "auto",
        "Qwen3-Next-80B-A3B: 36 Gated-DeltaNet + 12 full-attention layers (GQA, 2 KV "
        "heads of 256), BF16 weights"),
    "gpt-oss-120b": ModelPreset(
        _gpt_oss_120b(), "bf16", "mxfp4", "auto",
        "gpt-oss-120b: 18 sliding-window (128) + 18 full-attention layers (8 KV heads of "
        "64); experts MXFP4 (4.25 bits/param), the rest BF16"),
}


@dataclass(frozen=True)
class ClusterPreset:
    gpus: int
    gpus_per_node: int
    gpu_gib: float
    host_gib_per_gpu: float
    tp: int
    max_num_batched_tokens: int
    max_num_seqs: int = 1024
    note: str = ""  # the GPU and the serve defaults
    host_note: str = ""  # where host_gib_per_gpu comes from (dropped when a plan overrides it)


def host_memory_note(host_gib_per_gpu: float, source: str) -> str:
    """The printed assumption for a cluster's host pools: the figure used, and its source."""
    return (f"{host_gib_per_gpu:g} GiB host memory per GPU given to KV pools"
            + (f" ({source})" if source else " (given, not a preset's)"))


CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    # Host memory: the cited 8xH200 nodes have 2 TiB (MLPerf Inference v4.1's H200-SXM-141GBx8
    # system: 32 x 64 GB; AWS p5e / p5en.48xlarge: 2,048 GiB), 256 GiB per GPU; vendors differ.
    # The KV pools get three quarters of it (an assumption of this planner, not a measured
    # figure: the rest for the OS, the engine processes and pinned staging). Until 2026-12-07
    # this preset gave 128 GiB, a figure with no source. ulacache's V4 multiple is the host
    # pool's: 3x stock at 64K needs at least 164 GiB per GPU (`benchmarks/results/planner_v4.md`).
    "8xH200": ClusterPreset(
        8, 8, 140.0, 192.0, 8, 8192,
        note=("H200: 140 GiB per GPU (the driver reports 143771 MiB for the 141 GB part); "
              "vLLM's serve defaults for 70-160 GiB GPUs (max_num_batched_tokens 8192, "
              "max_num_seqs 1024)"),
        host_note=("assumed: three quarters of the 256 GiB per GPU of a 2 TiB 8xH200 node "
                   "(MLPerf's H200-SXM-141GBx8 system, AWS p5e.48xlarge), the rest for the OS, "
                   "the engine processes and pinned staging")),
    "8xB300": ClusterPreset(
        8, 8, 268.0, 192.0, 8, 16384,
        note=("B300: 268 GiB per GPU (288 GB HBM3e; the driver's exact figure not checked "
              "here); vLLM's serve defaults for >= 160 GiB GPUs (max_num_batched_tokens "
              "16384, max_num_seqs 1024)"),
        host_note="the preset's figure, not checked against a B300 node's memory"),
}

# Bytes per parameter of a weights dtype (block scales of FP8 ignored; MXFP4: 4-bit values
# plus one 8-bit scale per 32; NVFP4: 4-bit values plus one FP8 scale per 16).
WEIGHT_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "fp16": 2.0, "bfloat16": 2.0,
                "float16": 2.0, "fp8": 1.0, "int8": 1.0, "mxfp4": 4.25 / 8, "nvfp4": 4.5 / 8,
                "int4": 0.5}
