"""A model as the planner sees it: its config.json fields, its kind (DSA, GDN hybrid,
sliding-window hybrid, DeepSeek-V4), its parameter split (dense / routed experts) and the
per-rank KV cache specs vLLM would build for it. vLLM is imported only inside the spec
builders (DeepSeek-V4's caches: ``v4_layout``, plain arithmetic)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlannerError
from .presets import MODEL_PRESETS
from .v4_layout import v4_params


@dataclass
class ModelShape:
    name: str
    config: dict[str, Any]
    kind: str  # "dsa" | "gdn" | "swa" | "v4"
    dense_params: int
    expert_params: int
    weights_dtype: str = "bf16"
    expert_weights_dtype: str = "bf16"
    kv_dtype: str = "auto"
    notes: list[str] = field(default_factory=list)
    mamba_ssm_cache_dtype: str = "auto"  # vLLM's --mamba-ssm-cache-dtype (GDN's SSM state)

    @property
    def max_len(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def model_dtype(self) -> str:
        return str(self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")


def load_model(model: str | Path, params_b: float | None = None,
               expert_params_b: float | None = None) -> ModelShape:
    """A preset name, a config.json path, or a model directory holding one."""
    key = str(model)
    if key in MODEL_PRESETS:
        p = MODEL_PRESETS[key]
        cfg, name = dict(p.config), key
        dt = dict(weights_dtype=p.weights_dtype, expert_weights_dtype=p.expert_weights_dtype,
                  kv_dtype=p.kv_dtype)
        notes = [p.note]
    else:
        path = Path(key)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise PlannerError(
                f"unknown model {key!r}: not a preset ({', '.join(MODEL_PRESETS)}) and no "
                f"config.json at that path. Pass a preset name or a path to a config.json "
                f"(or the model directory holding it).")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise PlannerError(f"cannot read {path}: {e}. Pass a valid config.json.") from None
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        name = str(path.parent.name or path)
        mdt = _short(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
        quant = (cfg.get("quantization_config") or {}).get("quant_method", "")
        if quant == "fp8" and model_kind(cfg) == "v4":  # vLLM's DeepseekV4FP8Config
            experts = "mxfp4" if cfg.get("expert_dtype", "fp4") == "fp4" else "fp8"
            dt = dict(weights_dtype="fp8", expert_weights_dtype=experts, kv_dtype="auto")
        elif quant == "fp8":
            dt = dict(weights_dtype="fp8", expert_weights_dtype="fp8", kv_dtype="auto")
        elif quant == "mxfp4":
            dt = dict(weights_dtype=mdt, expert_weights_dtype="mxfp4", kv_dtype="auto")
        else:
            dt = dict(weights_dtype=mdt, expert_weights_dtype=mdt, kv_dtype="auto")
        notes = [f"config.json from {path}"]
    kind = model_kind(cfg)
    if params_b is not None:
        experts = int((expert_params_b or 0) * 1e9)
        dense = int(params_b * 1e9) - experts
        notes.append(f"parameters given: {params_b}B in all, {experts / 1e9:g}B routed experts")
    else:
        dense, experts = count_params(cfg, kind)
    return ModelShape(name, cfg, kind, dense, experts, notes=notes, **dt)


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def model_kind(cfg: dict[str, Any]) -> str:
    if cfg.get("model_type") == "deepseek_v41":
        raise PlannerError("DeepSeek-V4.1 (layer-shared KV and top-k, C1A/C2A layers) is not "
                           "modelled; DeepSeek-V4 (model_type deepseek_v4) is.")
    if cfg.get("model_type") == "deepseek_v4" or "compress_ratios" in cfg:
        return "v4"
    if cfg.get("index_topk"):
        return "dsa"
    types = set(cfg.get("layer_types") or ())
    if cfg.get("model_type") == "qwen3_next" or "linear_attention" in types:
        return "gdn"
    if cfg.get("model_type") == "gpt_oss" or "sliding_attention" in types:
        return "swa"
    raise PlannerError(
        f"model type {cfg.get('model_type')!r} ({', '.join(cfg.get('architectures') or [])}) "
        f"is not one the planner models: DSA sparse-MLA models (config with index_topk: "
        f"DeepSeek-V3.2, GLM-5), DeepSeek-V4, Gated-DeltaNet hybrids (Qwen3-Next) and "
        f"sliding-window hybrids (gpt-oss). Pass one of those, or a preset: "
        f"{', '.join(MODEL_PRESETS)}.")


# ---------------------------------------------------------------- parameters (dense, experts)

def count_params(cfg: dict[str, Any], kind: str) -> tuple[int, int]:
    """(dense params, routed-expert params) from the config's shapes; biases and norms are
    left out (well under 0.1%), MTP / next-n layers too (not loaded without speculation)."""
    try:
        return {"dsa": _mla_moe_params, "gdn": _qwen3_next_params,
                "swa": _gpt_oss_params, "v4": v4_params}[kind](cfg)
    except KeyError as e:
        raise PlannerError(
            f"config lacks {e} needed to count parameters; pass --params-b (and "
            f"--expert-params-b) to give them") from None


def _embeddings(c) -> int:
    return c["vocab_size"] * c["hidden_size"] * (1 if c.get("tie_word_embeddings") else 2)


def _mla_moe_params(c) -> tuple[int, int]:
    h, L, nh = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    ql, kvl, rope = c.get("q_lora_rank"), c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    q = (h * ql + ql * nh * (nope + rope)) if ql else h * nh * (nope + rope)
    attn = q + h * (kvl + rope) + kvl * nh * (nope + v) + nh * v * h
    ih, idim = c.get("index_n_heads", 0), c.get("index_head_dim", 0)
    indexer = (ql or h) * ih * idim + h * idim + h * ih
    n_idx = len(indexer_layers(c))
    kinds = c.get("mlp_layer_types") or [
        "dense" if i < c.get("first_k_dense_replace", 0) else "sparse" for i in range(L)]
    n_moe = sum(k == "sparse" for k in kinds)
    e, mi = c.get("n_routed_experts") or 0, c.get("moe_intermediate_size", 0)
    experts = n_moe * e * 3 * h * mi
    shared = n_moe * ((c.get("n_shared_experts") or 0) * 3 * h * mi + e * h)
    dense = L * attn + n_idx * indexer + (L - n_moe) * 3 * h * c["intermediate_size"] \
        + shared + _embeddings(c)
    return dense, experts


def _qwen3_next_params(c) -> tuple[int, int]:
    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    full = h * nh * hd * 2 + 2 * h * kvh * hd + nh * hd * h  # q carries its output gate
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    linear = h * (2 * nk * dk + 2 * nv * dv) + h * 2 * nv + conv_dim * \
        c["linear_conv_kernel_dim"] + nv * dv * h
    types = c.get("layer_types") or []
    n_full = sum(t == "full_attention" for t in types)
    step, only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
    moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    e, mi = c["num_experts"], c["moe_intermediate_size"]
    experts = len(moe) * e * 3 * h * mi
    shared = len(moe) * (3 * h * c.get("shared_expert_intermediate_size", 0) + h + e * h)
    dense = n_full * full + (L - n_full) * linear + shared \
        + (L - len(moe)) * 3 * h * c["intermediate_size"] + _embeddings(c)
    return dense, experts


def _gpt_oss_params(c) -> tuple[int, int]:
    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attn = h * nh * hd + 2 * h * kvh * hd + nh * hd * h
    e, mi = c["num_local_experts"], c["intermediate_size"]
    experts = L * e * 3 * h * mi
    dense = L * (attn + e * h) + _embeddings(c)
    return dense, experts


# ---------------------------------------------------------------- per-rank KV cache specs

def indexer_layers(c: dict[str, Any]) -> list[int]:
    """Layers that build a DSA indexer (and so an indexer key cache), by vLLM's rule in
    deepseek_v2.py: `index_topk_pattern` ("S" skips) or `index_topk_freq` with
    `index_skip_topk_offset` (default: every layer)."""
    L = c["num_hidden_layers"]
    pattern = c.get("index_topk_pattern")
    freq, offset = c.get("index_topk_freq", 1) or 1, c.get("index_skip_topk_offset", 2)
    out = []
    for i in range(L):
        if pattern is None:
            skip = max(i - offset + 1, 0) % freq != 0
        else:
            skip = i < len(pattern) and pattern[i] == "S"
        if not skip:
            out.append(i)
    return out


FP8_DS_MLA_ROW = 656  # vLLM's fp8_ds_mla row: 512 fp8 NoPE + 16 B scales + 64 bf16 RoPE
_FP8 = ("fp8", "fp8_ds_mla", "fp8_e4m3")


def _torch_dtype(name: str):
    import torch

    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
             "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
    if name not in table:
        raise PlannerError(f"unknown dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def kv_dtype_of(shape: ModelShape, kv_dtype: str | None) -> str:
    """The KV dtype name in effect ('auto' resolves to the model dtype)."""
    name = (kv_dtype or shape.kv_dtype or "auto").lower()
    if shape.kind == "v4":
        if name == "auto" or name in _FP8:  # vLLM's V4 turns auto / fp8 into fp8_ds_mla
            return "fp8_ds_mla"
        raise PlannerError(f"--kv-dtype {name}: the planner models DeepSeek-V4's fp8_ds_mla "
                           f"cache only (vLLM's FlashMLA path; 'auto' becomes fp8_ds_mla)")
    if name == "auto":
        name = _short(shape.model_dtype)
    if shape.kind == "dsa" and name in _FP8:
        return "fp8_ds_mla"
    _torch_dtype(name)  # validates
    return name


def dsa_specs(shape: ModelShape, kv_dtype: str, block_size: int) -> dict:
    """One rank's specs as vLLM builds them for DeepSeek-V3.2 / GLM DSA: a sparse-MLA spec per
    layer (head 512 + 64, `max_tp_shards=1`: every TP rank holds all of it) and an indexer
    key cache per indexer layer (index_head_dim fp8 + 4 B scale per 128, uint8)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec,
        SparseCacheRole,
        get_kv_quant_mode,
    )

    c = shape.config
    head = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    if kv_dtype == "fp8_ds_mla":
        mla_kw = dict(dtype=torch.uint8, cache_dtype_str="fp8_ds_mla",
                      kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
                      state_content_bytes=FP8_DS_MLA_ROW)
    else:
        mla_kw = dict(dtype=_torch_dtype(kv_dtype), cache_dtype_str="auto")
    idim = c["index_head_dim"]
    with_indexer = set(indexer_layers(c))
    specs = {}
    for i in range(c["num_hidden_layers"]):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head,
            is_index_group_leader=i in with_indexer, **mla_kw)
        if i in with_indexer:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=idim + idim // 128 * 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER)
    return specs


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """vLLM's split of GQA KV heads over TP: heads / tp, at least one (replicated beyond)."""
    return max(1, shape.config["num_key_value_heads"] // tp)


def gdn_state(shape: ModelShape, tp: int, spec_tokens: int = 0):
    """(shapes, dtypes) of one Gated-DeltaNet layer's state on one rank, from vLLM's own
    calculators (conv state: the model dtype, vLLM's 'auto' mamba cache dtype; SSM state: the
    shape's `mamba_ssm_cache_dtype`, 'auto' = the model dtype)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    c = shape.config
    for what in ("linear_num_value_heads", "linear_num_key_heads"):
        if c[what] % tp:
            raise PlannerError(f"--tp {tp} does not divide {what}={c[what]} of this model "
                               f"(vLLM shards the GDN state by heads); pick a TP that does.")
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
        c["linear_value_head_dim"], c["linear_conv_kernel_dim"], spec_tokens)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        _torch_dtype(_short(shape.model_dtype)), "auto", shape.mamba_ssm_cache_dtype)
    return shapes, dtypes


def state_bytes(shapes, dtypes) -> int:
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))


def attention_token_bytes(shape: ModelShape, kv_dtype: str, tp: int) -> int:
    """K + V bytes of one token in one attention layer on one rank."""
    head = shape.config.get("head_dim") or shape.config["hidden_size"] // \
        shape.config["num_attention_heads"]
    return 2 * kv_heads_per_rank(shape, tp) * head * _torch_dtype(kv_dtype).itemsize


def hybrid_specs(shape: ModelShape, kv_dtype: str, tp: int, block_size: int = 16,
                 kernel_block: int = 16) -> tuple[dict, int]:
    """(one rank's specs, attention block size) as stock vLLM builds them. GDN hybrids: the
    attention block grows until its page holds a state, and the state page is padded to the
    attention page (the arithmetic of vLLM's `Platform._align_hybrid_block_size`, with
    FlashAttention's 16-token kernel blocks); mamba_cache_mode 'align' (vLLM's default with
    prefix caching, which hybrids enable by default). Sliding-window hybrids: 16-token blocks."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    c = shape.config
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attn_kw = dict(num_kv_heads=kv_heads_per_rank(shape, tp), head_size=head,
                   dtype=_torch_dtype(kv_dtype))
    types = c["layer_types"]
    specs = {}
    if shape.kind == "gdn":
        shapes, dtypes = gdn_state(shape, tp)
        state = state_bytes(shapes, dtypes)
        tok = FullAttentionSpec(block_size=1, **attn_kw).page_size_bytes
        bs = kernel_block * -(-state // (kernel_block * tok))
        bs = max(bs, block_size)
        page = bs * tok
        for i, t in enumerate(types):
            if t == "full_attention":
                specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                    block_size=bs, **attn_kw)
            else:
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    shapes=shapes, dtypes=dtypes, block_size=bs, page_size_padded=page,
                    mamba_cache_mode="align")
        return specs, bs
    for i, t in enumerate(types):
        if t == "sliding_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                block_size=block_size, sliding_window=c["sliding_window"], **attn_kw)
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block_size, **attn_kw)
    return specs, block_size


def arena_specs(shape: ModelShape, kv_dtype: str, tp: int, max_model_len: int) -> dict:
    """One rank's specs as vLLM builds them under `--kv-backend ulacache` (the arena): no
    hybrid block alignment (`patches/hybrid_block_size.py` skips it), attention and sliding
    layers in `engine.arena.sizing.ARENA_BLOCK_SIZE`-token pages, a GDN state page of exactly the
    state's bytes (no `page_size_padded`), mamba_cache_mode 'none' (ulacache turns prefix
    caching off) with vLLM's mamba block of max_model_len."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from ulacache_vllm.engine.arena.sizing import ARENA_BLOCK_SIZE

    c = shape.config
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attn_kw = dict(block_size=ARENA_BLOCK_SIZE, num_kv_heads=kv_heads_per_rank(shape, tp),
                   head_size=head, dtype=_torch_dtype(kv_dtype))
    state = gdn_state(shape, tp) if shape.kind == "gdn" else None
    specs = {}
    for i, t in enumerate(c["layer_types"]):
        if t == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(**attn_kw)
        elif t == "sliding_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                sliding_window=c["sliding_window"], **attn_kw)
        elif state is not None:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=state[0], dtypes=state[1], block_size=max_model_len,
                mamba_cache_mode="none")
        else:
            raise PlannerError(f"layer {i} of type {t!r}: the planner models full, sliding "
                               f"and linear (GDN) attention layers only")
    return specs
