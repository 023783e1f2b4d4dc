"""Tiny DeepSeek-V4 (``DeepseekV4ForCausalLM``) for vLLM's CPU build: config, checks, weights.

V4's checkpoint is written directly in DeepSeek's own tensor names (``layers.N.attn.wq_a``,
``layers.N.ffn.experts.E.w1``, ``hc_head_fn``, ...), which vLLM's V4 loader reads and which
transformers' DeepSeek-V4 class loads through its conversion mapping. (transformers'
``save_pretrained`` does not write names vLLM can load, so the other families' path through
``from_config`` is not used.) config.json carries the legacy keys vLLM's V4 reads
(``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``); transformers folds them
into its schema itself.

Weights are real random ones, not ``load_format="dummy"``'s U(+-1e-3) (with those the output
ignores the prompt): RMSNorm weights 1, every matrix N(0, 1/fan_in) (the embedding N(0, 1)),
the bias-like vectors (attention sink, compressor position bias, mHC bases, router
correction bias) small random values, mHC scales 1, and a random hash-routing table; each
tensor from its own seed (derived from ``seed`` and its name), so the files are reproducible.

The CPU kernels fix some shapes; ``check_config`` refuses what they do not take, naming the
kernel (see ``../shared/reference/deepseek-v4-notes.md`` §2.3).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

NAME = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"

# Layer kinds: 0 = sliding window only, 4 = CSA (compressed sparse, with the lightning
# indexer), 128 = HCA (heavily compressed, dense).
KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention",
         128: "heavily_compressed_attention"}

# Small enough to boot in seconds, with every kind of layer once and both routers (hash
# routing on layer 0, biased top-k after).
DEFAULTS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=3,
    compress_ratios=[0, 4, 128],
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=512,              # CPU attention kernel: 448 NoPE + 64 RoPE
    qk_rope_head_dim=64,
    q_lora_rank=128,
    o_lora_rank=128,           # bmm_cpu: a multiple of 32
    o_groups=2,
    sliding_window=128,
    index_topk=512,            # topk_transform_512_cpu
    index_n_heads=16,
    index_head_dim=128,        # fused_indexer_q_rope_quant_cpu / fp8_paged_mqa_logits_cpu
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "default"},  # vLLM's V4 rope reads it (None crashes)
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    n_routed_experts=64,       # biased_topk_cpu / hash_topk_cpu: 64, 128, 256 or 384
    num_experts_per_tok=6,     # ... and 6 or 8
    moe_intermediate_size=64,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",    # vLLM gives non-hash routers their correction bias only then
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    hidden_act="silu",
    num_hash_layers=1,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)

# The router's kernels (csrc topk.cpp dispatch tables) take these (experts, top-k) pairs.
_EXPERTS = (64, 128, 256, 384)


class V4ConfigError(ValueError):
    """A tiny-V4 config the CPU kernels (or the reference) would refuse."""


def check_config(cfg: dict[str, Any]) -> None:
    """Raises V4ConfigError naming the kernel that refuses the shape."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise V4ConfigError(f"deepseek_v4: {msg}")

    need((cfg["head_dim"], cfg["qk_rope_head_dim"]) == (512, 64),
         f"head_dim/qk_rope_head_dim must be 512/64 (flash_mla_with_kvcache_cpu and the "
         f"fp8_ds_mla cache hard-code 448 NoPE + 64 RoPE), got {cfg['head_dim']}/"
         f"{cfg['qk_rope_head_dim']}")
    need(cfg["index_head_dim"] == 128, f"index_head_dim must be 128 "
         f"(fused_indexer_q_rope_quant_cpu, fp8_paged_mqa_logits_cpu), got "
         f"{cfg['index_head_dim']}")
    need(cfg["index_topk"] == 512, f"index_topk must be 512 (topk_transform_512_cpu, which "
         f"the indexer runs once a prompt passes 4 x index_topk tokens), got {cfg['index_topk']}")
    need(cfg["num_key_value_heads"] == 1, "num_key_value_heads must be 1 (V4's shared-KV MQA)")
    need(cfg["o_lora_rank"] % 32 == 0, f"o_lora_rank must be a multiple of 32 (bmm_cpu), got "
         f"{cfg['o_lora_rank']}")
    need(cfg["num_attention_heads"] % cfg["o_groups"] == 0,
         "num_attention_heads must be a multiple of o_groups (grouped output projection)")
    need(cfg["hc_mult"] >= 2, f"hc_mult must be >= 2 (the mHC kernels), got {cfg['hc_mult']}")
    ratios = cfg["compress_ratios"]
    need(isinstance(ratios, list) and len(ratios) == cfg["num_hidden_layers"],
         f"compress_ratios needs one entry per layer ({cfg['num_hidden_layers']}), got {ratios}")
    need(all(r in KINDS for r in ratios),
         f"compress_ratios entries must be 0 (sliding window), 4 (CSA) or 128 (HCA), got {ratios}")
    need(cfg["scoring_func"] == "sqrtsoftplus",
         f"scoring_func must be sqrtsoftplus (V4's router; vLLM's CPU build ignores the hash "
         f"table under softmax routing), got {cfg['scoring_func']!r}")
    need(cfg["topk_method"] == "noaux_tc", "topk_method must be noaux_tc (vLLM's V4 gives the "
         "non-hash routers their correction bias only then; the CPU router requires it)")
    experts, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    need(experts in _EXPERTS, f"n_routed_experts must be one of {_EXPERTS} "
         f"(biased_topk_cpu/hash_topk_cpu), got {experts}")
    n_hash = cfg["num_hash_layers"]
    if n_hash < cfg["num_hidden_layers"]:
        need(k in (6, 8) or (k == 9 and experts == 256),
             f"num_experts_per_tok must be 6 or 8 (9 with 256 experts) for biased_topk_cpu, "
             f"got {k}")
    if n_hash > 0:
        need(k in (6, 7, 8), f"num_experts_per_tok must be 6, 7 or 8 for hash_topk_cpu, got {k}")
    need(k <= experts, "num_experts_per_tok exceeds n_routed_experts")
    need(cfg["n_shared_experts"] == 1, "n_shared_experts must be 1 (vLLM's V4 loads one "
         "shared expert group; transformers' V4, the reference, builds exactly one)")
    need(cfg["num_nextn_predict_layers"] == 0, "num_nextn_predict_layers must be 0: MTP drafts "
         "are stubs on vLLM's CPU build and no MTP weights are built")
    need(cfg["hidden_act"] == "silu", "hidden_act must be silu (vLLM's V4 MLP)")
    need(cfg["dtype"] == cfg["torch_dtype"] == "bfloat16", "dtype must be bfloat16 (the CPU "
         "attention kernel takes bf16 queries only)")
    need((cfg["model_type"], cfg["architectures"]) == (NAME, [ARCHITECTURE]),
         f"model_type/architectures must stay {NAME}/[{ARCHITECTURE}]")
    need(cfg["vocab_size"] >= 300, "vocab_size must be >= 300 (the byte-level tokenizer)")


def make_config(overrides: dict[str, Any] | None, special_ids: dict[str, int]) -> dict[str, Any]:
    """DEFAULTS, the tokenizer's special ids, then ``overrides`` (any key), checked."""
    cfg = {**DEFAULTS, "architectures": [ARCHITECTURE], "model_type": NAME,
           "dtype": "bfloat16", "torch_dtype": "bfloat16", **special_ids, **(overrides or {})}
    check_config(cfg)
    return cfg


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def tensor_specs(cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, dtype, init) of every checkpoint tensor, in DeepSeek's names. init:
    ``ones``, ``fan_in`` (N(0, 1/shape[-1])), ``normal`` (N(0, 1)), ``small`` (N(0, 0.25)),
    ``tiny`` (N(0, 0.01)), ``hash`` (a table of distinct experts per token)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, hd = cfg["num_attention_heads"], cfg["head_dim"]
    ql, ol, og = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    E, inter, m = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hc_mult"]
    mix = (2 + m) * m
    bf, f32 = "bfloat16", "float32"
    s: dict[str, tuple[tuple[int, ...], str, str]] = {
        "embed.weight": ((V, H), bf, "normal"),
        "head.weight": ((V, H), bf, "fan_in"),
        "norm.weight": ((H,), bf, "ones"),
        "hc_head_fn": ((m, m * H), f32, "fan_in"),
        "hc_head_base": ((m,), f32, "small"),
        "hc_head_scale": ((1,), f32, "ones"),
    }

    def compressor(pre: str, ratio: int, dim: int) -> None:
        c = 2 if ratio == 4 else 1  # CSA windows overlap: two series per token
        s[f"{pre}.wkv.weight"] = ((c * dim, H), bf, "fan_in")
        s[f"{pre}.wgate.weight"] = ((c * dim, H), bf, "fan_in")
        s[f"{pre}.ape"] = ((ratio, c * dim), f32, "small")
        s[f"{pre}.norm.weight"] = ((dim,), bf, "ones")

    for i, ratio in enumerate(cfg["compress_ratios"]):
        p = f"layers.{i}"
        s[f"{p}.attn_norm.weight"] = ((H,), bf, "ones")
        s[f"{p}.ffn_norm.weight"] = ((H,), bf, "ones")
        for site in ("attn", "ffn"):
            s[f"{p}.hc_{site}_fn"] = ((mix, m * H), f32, "fan_in")
            s[f"{p}.hc_{site}_base"] = ((mix,), f32, "small")
            s[f"{p}.hc_{site}_scale"] = ((3,), f32, "ones")
        a = f"{p}.attn"
        s[f"{a}.wq_a.weight"] = ((ql, H), bf, "fan_in")
        s[f"{a}.q_norm.weight"] = ((ql,), bf, "ones")
        s[f"{a}.wq_b.weight"] = ((nh * hd, ql), bf, "fan_in")
        s[f"{a}.wkv.weight"] = ((hd, H), bf, "fan_in")
        s[f"{a}.kv_norm.weight"] = ((hd,), bf, "ones")
        s[f"{a}.wo_a.weight"] = ((og * ol, nh * hd // og), bf, "fan_in")
        s[f"{a}.wo_b.weight"] = ((H, og * ol), bf, "fan_in")
        s[f"{a}.attn_sink"] = ((nh,), f32, "normal")
        if ratio > 1:
            compressor(f"{a}.compressor", ratio, hd)
        if ratio == 4:
            s[f"{a}.indexer.wq_b.weight"] = ((ih * ihd, ql), bf, "fan_in")
            s[f"{a}.indexer.weights_proj.weight"] = ((ih, H), bf, "fan_in")
            compressor(f"{a}.indexer.compressor", 4, ihd)
        f = f"{p}.ffn"
        s[f"{f}.gate.weight"] = ((E, H), bf, "fan_in")
        if i < cfg["num_hash_layers"]:
            s[f"{f}.gate.tid2eid"] = ((V, cfg["num_experts_per_tok"]), "int32", "hash")
        else:
            s[f"{f}.gate.bias"] = ((E,), f32, "tiny")
        for e in range(E):
            s[f"{f}.experts.{e}.w1.weight"] = ((inter, H), bf, "fan_in")
            s[f"{f}.experts.{e}.w3.weight"] = ((inter, H), bf, "fan_in")
            s[f"{f}.experts.{e}.w2.weight"] = ((H, inter), bf, "fan_in")
        shared = inter * cfg["n_shared_experts"]
        s[f"{f}.shared_experts.w1.weight"] = ((shared, H), bf, "fan_in")
        s[f"{f}.shared_experts.w3.weight"] = ((shared, H), bf, "fan_in")
        s[f"{f}.shared_experts.w2.weight"] = ((H, shared), bf, "fan_in")
    return s


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    out = {}
    for name, (shape, dtype, init) in tensor_specs(cfg).items():
        g = torch.Generator().manual_seed(_seed_of(seed, name))
        if init == "ones":
            t = torch.ones(shape)
        elif init == "hash":
            rows, k = shape
            experts = cfg["n_routed_experts"]
            t = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)])
        else:
            std = {"fan_in": shape[-1] ** -0.5, "normal": 1.0, "small": 0.25, "tiny": 0.01}[init]
            t = torch.randn(shape, generator=g) * std
        out[name] = t.to(getattr(torch, dtype)).contiguous()
    return out


def write(d: Path, overrides: dict[str, Any] | None, seed: int,
          special_ids: dict[str, int]) -> dict[str, Any]:
    """Writes config.json, generation_config.json and model.safetensors into ``d`` (which
    already holds the tokenizer); returns the config."""
    from safetensors.torch import save_file

    cfg = make_config(overrides, special_ids)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    tensors = random_weights(cfg, seed)
    save_file(dict(sorted(tensors.items())), str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "model.safetensors").chmod(0o644)
    return cfg
