"""Builds a tiny random-weight model directory (config.json + safetensors + tokenizer).

Deterministic: the same name, overrides and seed give byte-identical files. Weights are
initialised by transformers (``from_config`` under ``torch.manual_seed``) in fp32 and saved
as bfloat16. ``weights_from`` builds a family from another checkpoint's weights instead (e.g.
a DeepSeek-V3 dense-MLA twin of a DeepSeek-V3.2 DSA model: same tensors minus the indexer).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import deepseek_v4
from .configs import FAMILIES, INIT_RANGE, MODEL_NAMES
from .tokenizer import save_tokenizer

# Families whose checkpoint is written directly in the names vLLM loads (transformers'
# from_config/save_pretrained does not write them): name -> module with ``write``.
DIRECT = {deepseek_v4.NAME: deepseek_v4}
ALL_MODEL_NAMES: tuple[str, ...] = MODEL_NAMES + tuple(DIRECT)

BUILD_INFO = "ulacache_build.json"  # marks a directory this factory wrote (safe to replace)
WEIGHTS = "model.safetensors"

# Config keys never taken over from a weights_from source: identity, not shape. index_topk
# is a selection setting, not a weight shape, so it comes from the family or overrides
# (a top-k 512 checkpoint's weights can be rebuilt as a top-k 16 model).
_NOT_SHAPE = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
              "_name_or_path", "auto_map", "layer_types", "num_nextn_predict_layers",
              "index_topk"}


def _config_class(name: str):
    import transformers

    return getattr(transformers, FAMILIES[name].config_class)


def _kwargs_from_source(name: str, src: Path) -> dict[str, Any]:
    """Shape settings of a source checkpoint that the target family's config understands."""
    src_cfg = json.loads((src / "config.json").read_text())
    known = set(_config_class(name)().to_dict()) | set(FAMILIES[name].extra_json)
    return {k: v for k, v in src_cfg.items()
            if k in known and k not in _NOT_SHAPE}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_config(name: str, kwargs: dict[str, Any], special_ids: dict[str, int]):
    fam = FAMILIES[name]
    cfg = _config_class(name)(
        **{"initializer_range": INIT_RANGE, **special_ids, **kwargs},
        architectures=[fam.architecture],
    )
    return cfg


def _finish_config(name: str, d: Path, kwargs: dict[str, Any]) -> None:
    """Rewrite config.json with the fields save_pretrained may drop and a stable key order."""
    cfg = json.loads((d / "config.json").read_text())
    for k, v in FAMILIES[name].extra_json.items():
        cfg[k] = kwargs.get(k, v)
    cfg["dtype"] = "bfloat16"
    _write_json(d / "config.json", cfg)


def _random_weights(config, d: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(d), safe_serialization=True)


def _is_moe_layer(kwargs: dict[str, Any], i: int) -> bool:
    """Whether vLLM's DeepSeek decoder layer ``i`` (an MTP layer's block too) has routed
    experts: `DeepseekV2DecoderLayer`'s rule."""
    return (kwargs.get("n_routed_experts") is not None
            and i >= int(kwargs.get("first_k_dense_replace", 0))
            and i % int(kwargs.get("moe_layer_freq", 1) or 1) == 0)


def _deeper_layers(name: str, kwargs: dict[str, Any], layers: int, seed: int) -> dict[str, Any]:
    """The saved tensors of the same family and shape built ``layers`` deep (seed + 2)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as t:
        _random_weights(_make_config(name, {**kwargs, "num_hidden_layers": layers}, {}),
                        Path(t), seed + 2)
        return load_file(str(Path(t) / WEIGHTS))


def _add_mtp_layers(d: Path, name: str, kwargs: dict[str, Any], seed: int) -> None:
    """Append DeepSeek MTP (next-n prediction) layers, which transformers does not build.

    Layer ``N + i`` (vLLM's `DeepSeekMTP` names) gets a copy of the last decoder layer of its
    own kind (MoE or dense MLP, as vLLM builds layer ``N + i``) as its block, unit
    `enorm`/`hnorm`, the final norm and LM head as `shared_head`, and an `eh_proj` that mostly
    passes the previous hidden state through (so drafts are sometimes accepted even with
    random weights).

    Option (an override, kept in config.json as a record; vLLM ignores it)
    ``mtp_block_scale=S``: an MTP layer built to agree with its target. `eh_proj` passes the
    previous hidden state through exactly (no embedding term) and the block's output
    projections (attention `o_proj`, every expert's and the shared expert's `down_proj`) are
    scaled by S, so the layer mostly reproduces the target's last hidden state: its draft is
    the target's last token again, accepted wherever the target repeats itself (a random
    target does on prompts of one repeated word), rejected elsewhere. S > 0 keeps the block's
    attention over the MTP layer's own KV (its indexer, its rows) in the draft: at S 0.1 it
    still changes about a quarter of the accepted drafts.
    """
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / WEIGHTS))
    n = int(kwargs["num_hidden_layers"])
    hidden = int(kwargs["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 1)
    scale = kwargs.get("mtp_block_scale")
    scale = None if scale is None else float(scale)
    k_mtp = int(kwargs["num_nextn_predict_layers"])
    extra: dict[str, Any] | None = None
    for i in range(k_mtp):
        pre = f"model.layers.{n + i}."
        # The block's MLP is what vLLM builds for layer n + i (MoE or dense): a copy of the
        # last decoder layer of that kind, else (every decoder layer of the other kind) the
        # layer transformers builds at that index in a deeper model of the same shape.
        same = [j for j in range(n) if _is_moe_layer(kwargs, j) == _is_moe_layer(kwargs, n + i)]
        if same:
            src, last = tensors, f"model.layers.{same[-1]}."
        else:
            extra = extra if extra is not None else _deeper_layers(name, kwargs, n + k_mtp, seed)
            src, last = extra, pre
        for k in [k for k in src if k.startswith(last)]:
            tensors[pre + k[len(last):]] = src[k].clone()
        tensors[pre + "enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[pre + "hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        eh = torch.cat([0.05 * torch.randn(hidden, hidden, generator=gen),
                        torch.eye(hidden)], dim=1)
        if scale is not None:
            eh[:, :hidden] = 0.0
            for k in [k for k in tensors if k.startswith(pre) and
                      k.endswith(("self_attn.o_proj.weight", "down_proj.weight"))]:
                tensors[k] = (tensors[k].float() * scale).to(tensors[k].dtype)
        tensors[pre + "eh_proj.weight"] = eh.to(torch.bfloat16)
        tensors[pre + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(d / WEIGHTS),
              metadata={"format": "pt"})


def _add_qwen3_next_mtp(d: Path, kwargs: dict[str, Any], seed: int) -> None:
    """Qwen3-Next's MTP module (vLLM's `Qwen3NextMTP` names, ``mtp.*``), which transformers
    does not build: layer ``i`` a copy of the last full-attention decoder layer, the norms
    copies of the final norm, and an ``fc`` over [embedding | hidden] that mostly passes the
    next token's embedding through: its guess leans on that token, as a random target's
    next-token logits partly do, so drafts are sometimes accepted, sometimes not."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / WEIGHTS))
    n = int(kwargs["num_hidden_layers"])
    hidden = int(kwargs["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 1)
    full = max(i for i in range(n) if f"model.layers.{i}.self_attn.q_proj.weight" in tensors)
    last = f"model.layers.{full}."
    norm = tensors["model.norm.weight"]
    for i in range(int(kwargs["num_nextn_predict_layers"])):
        pre = f"mtp.layers.{i}."
        for k in [k for k in tensors if k.startswith(last)]:
            tensors[pre + k[len(last):]] = tensors[k].clone()
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(hidden),
                                          0.05 * torch.randn(hidden, hidden, generator=gen)],
                                         dim=1).to(torch.bfloat16)
    for k in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        tensors[f"mtp.{k}.weight"] = norm.clone()
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(d / WEIGHTS),
              metadata={"format": "pt"})


def _copy_weights(d: Path, src: Path) -> list[str]:
    """Replace ``d``'s freshly saved weights by the source's tensors of the same names.

    The target was first saved with random weights so that its checkpoint names and shapes
    are exactly what save_pretrained writes (transformers fuses some tensors in memory, e.g.
    MoE experts, and splits them again on save). Returns the source tensors dropped.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(d / WEIGHTS), "pt") as f:
        want = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(f"weights_from {src} lacks tensors: {missing[:5]}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ValueError(f"{k}: source shape {tuple(tensors[k].shape)} != {shape}")
    save_file({k: tensors[k].contiguous() for k in sorted(want)}, str(d / WEIGHTS),
              metadata={"format": "pt"})
    return sorted(set(tensors) - set(want))


def build_model(
    name: str,
    outdir: str | os.PathLike,
    *,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    weights_from: str | os.PathLike | None = None,
) -> Path:
    """Build tiny model ``name`` into ``outdir`` and return its path.

    ``overrides`` replace config kwargs (e.g. ``{"index_topk": 64}``). ``weights_from``
    takes shapes and weights from an existing checkpoint directory (tensors the target
    architecture lacks, such as a DSA indexer, are dropped; ``index_topk`` is not taken
    over); ``overrides`` then must not change shapes. ``outdir`` is replaced if this factory wrote it before, refused if it
    holds anything else.
    """
    if name in DIRECT:
        return _build_direct(name, outdir, overrides=overrides, seed=seed,
                             weights_from=weights_from)
    if name not in FAMILIES:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(ALL_MODEL_NAMES)}")
    out = Path(outdir)
    if out.exists() and any(out.iterdir()) and not (out / BUILD_INFO).exists():
        raise FileExistsError(f"{out} exists and was not written by build_model")
    overrides = dict(overrides or {})
    src = Path(weights_from) if weights_from is not None else None

    kwargs = dict(FAMILIES[name].kwargs)
    info: dict[str, Any] = {"name": name, "seed": seed, "overrides": overrides}
    if src is not None:
        kwargs.update(_kwargs_from_source(name, src))
        src_info = src / BUILD_INFO
        info["weights_from"] = json.loads(src_info.read_text()) if src_info.exists() else str(src)
    kwargs.update(overrides)

    with _staged(out) as tmp:
        special_ids = save_tokenizer(tmp, kwargs["vocab_size"])
        config = _make_config(name, kwargs, special_ids)
        _random_weights(config, tmp, seed)
        mtp = src is None and int(kwargs.get("num_nextn_predict_layers", 0) or 0) > 0
        if mtp:
            if name == "qwen3_next":
                _add_qwen3_next_mtp(tmp, kwargs, seed)
            else:
                _add_mtp_layers(tmp, name, kwargs, seed)
        if src is not None:
            info["dropped_tensors"] = _copy_weights(tmp, src)
        _finish_config(name, tmp, kwargs)
        if mtp:  # (vLLM reads the MTP layer count from config.json)
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["num_nextn_predict_layers"] = int(kwargs["num_nextn_predict_layers"])
            _write_json(tmp / "config.json", cfg)
        _write_json(tmp / BUILD_INFO, info)
    return out


def _build_direct(name: str, outdir, *, overrides, seed: int, weights_from) -> Path:
    """``build_model`` for a DIRECT family (same directory contract)."""
    if weights_from is not None:
        raise ValueError(f"{name}: weights_from is not supported (its weights are written "
                         f"directly); use --seed and --set")
    mod = DIRECT[name]
    out = Path(outdir)
    if out.exists() and any(out.iterdir()) and not (out / BUILD_INFO).exists():
        raise FileExistsError(f"{out} exists and was not written by build_model")
    overrides = dict(overrides or {})
    mod.make_config(overrides, {})  # refuse a bad config before any work
    with _staged(out) as tmp:
        vocab = overrides.get("vocab_size", mod.DEFAULTS["vocab_size"])
        special_ids = save_tokenizer(tmp, vocab)
        mod.write(tmp, overrides, seed, special_ids)
        _write_json(tmp / BUILD_INFO, {"name": name, "seed": seed, "overrides": overrides})
    return out


@contextlib.contextmanager
def _staged(out: Path):
    """A fresh directory beside ``out`` that replaces it when the block succeeds and is
    removed when it fails: a half-written model directory is never seen."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model dir is meant to be shared
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_dense_twin(dsa_dir: str | os.PathLike, outdir: str | os.PathLike) -> Path:
    """DeepSeek-V3 dense-MLA model with a DSA checkpoint's weights (indexer dropped)."""
    return build_model("deepseek_v3", outdir, weights_from=dsa_dir)
