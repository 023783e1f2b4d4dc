"""Shapes of the tiny model families: transformers config class, architecture, kwargs.

Each family is as small as vLLM's CPU build allows while keeping the feature it exists
to exercise (DSA top-k, MLA head size 576, sliding windows, sinks, GDN state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB_SIZE = 1024
# Larger than transformers' 0.02 so the random logits are not all but flat (at hidden 256
# the logit std is ~16 * initializer_range).
INIT_RANGE = 0.05

# CPU MLA backends accept only head size 576 = kv_lora_rank 512 + qk_rope_head_dim 64.
_MLA = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    q_lora_rank=128,  # the DSA indexer's wq_b reads the q_a latent, so keep q LoRA
)

# DeepSeek-style MoE kept cheap: layer 0 dense, layer 1 with 4 small routed experts.
_DS_MOE = dict(
    moe_intermediate_size=128,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)

_DS_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    **_MLA,
    **_DS_MOE,
)

# vLLM reads these from config.json for the noaux_tc sigmoid router (it otherwise
# expects no e_score_correction_bias: KeyError at load); some transformers config classes
# drop them in save_pretrained, so the factory writes them into config.json itself.
_DS_ROUTER_JSON = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

_DSA = dict(index_topk=16, index_n_heads=8, index_head_dim=128)


@dataclass(frozen=True)
class Family:
    config_class: str  # name in `transformers`
    architecture: str  # vLLM / HF architecture written into config.json
    kwargs: dict[str, Any]
    extra_json: dict[str, Any] = field(default_factory=dict)  # forced into config.json
    dsa: bool = False  # needs the project's CPU sparse-MLA backend to run in vLLM
    mla: bool = False  # needs compilation_config custom_ops "-rotary_embedding" on CPU


FAMILIES: dict[str, Family] = {
    "deepseek_v32": Family(
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        {**_DS_COMMON, **_DSA},
        extra_json=_DS_ROUTER_JSON,
        dsa=True,
        mla=True,
    ),
    "glm_dsa": Family(
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        {**_DS_COMMON, **_DSA, "rms_norm_eps": 1e-5},
        # HF's GLM indexer applies interleaved RoPE; vLLM reads this flag (default False,
        # DeepSeek-V3.2's half-split style) to match it.
        extra_json={**_DS_ROUTER_JSON, "indexer_rope_interleave": True},
        dsa=True,
        mla=True,
    ),
    "deepseek_v3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**_DS_COMMON, "num_nextn_predict_layers": 0},
        extra_json=_DS_ROUTER_JSON,
        mla=True,
    ),
    "gpt_oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=4,  # sliding, full, sliding, full
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            max_position_embeddings=8192,
            # vLLM's gpt_oss requires YaRN parameters ("factor", ...); the factor matches
            # max_position_embeddings / original_max_position_embeddings so HF stays quiet.
            rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=6,  # 5 sliding : 1 full
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=128,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_next": Family(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,  # 3 GDN (linear) : 1 full attention
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            # vLLM's CPU GDN kernels need key/value head dims of 128
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    ),
    "llama": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    ),
}

MODEL_NAMES: tuple[str, ...] = tuple(FAMILIES)
