"""Lab: a tiny DeepSeek-V3.2 variant whose indexer top-k repeats from step to step, and the
measurement of that repeat (step-to-step top-k overlap) from ulacache's selection trace.

Why: the tiny random-weight DSA model's lightning indexer picks its top-k with little reuse
between decode steps, so ulacache's device pool (`dsa-pressure` in `benchmarks/equal_batch.py`)
moves many rows every step; a trained DSA model keeps most of its top-k from one decode step to
the next. This derives, from the benchmark's random model, a variant with a tunable reuse.

``stable:RHO`` (``build_variant``): every token embedding gets a shared component,
``e_i' = sqrt(RHO) * e0 * |e_i| + sqrt(1 - RHO) * e_i`` renormalised to ``|e_i|`` (``e0`` a unit
vector drawn from a fixed seed). Consecutive queries then share most of their direction, so
the indexer ranks the keys alike from one step to the next. ``stable:RHO:PE`` also scales the
RoPE half of every indexer key (the first ``qk_rope_head_dim`` entries of
``self_attn.indexer.k_norm`` weight and bias) by PE: the rotary part of a query-key score
changes with the query's position, so it reshuffles the ranking every step whatever RHO is.
Only ``model.embed_tokens.weight`` (and with PE the ``k_norm`` tensors) change; every other
tensor, the dtype (bf16), the tensor names and the config are the
source's, so the model loads in vLLM as the source does (the benchmark checks the outputs are
token-identical between stock and ulacache). Deterministic: same source, RHO and seed give
the same bytes.

``overlap_from_trace``: from a ``--ula-trace-path`` JSONL (ulacache's ``select`` records: the
logical addresses each layer group's first layer selected, with each address's request index in
the batch), per request and layer group, for every decode step (at most ``topk`` selections for
that request) whose previous step was also a decode step of that request: the fraction of this
step's selected addresses that were also selected in the previous step. Reported as the mean,
median and 10/90 % quantiles over all such (step, request, group) samples, the sample count,
and the same mean per layer group. This module never imports vLLM.

    python benchmarks/lab/stable_indexer.py build --rho 0.9          # models_cache/...-stable0.9
    python benchmarks/lab/stable_indexer.py overlap TRACE.jsonl --topk 16
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

VARIANT_PREFIX = "stable:"
EMBED = "model.embed_tokens.weight"
WEIGHTS = "model.safetensors"
BUILD_INFO = "ulacache_build.json"


def parse_variant(spec: str | None) -> tuple[float, float] | None:
    """``stable:RHO[:PE]`` -> (RHO in [0, 1), PE in (0, 1]; default 1) (None: no variant)."""
    if not spec:
        return None
    if not spec.startswith(VARIANT_PREFIX):
        raise ValueError(f"unknown DSA model variant {spec!r} (expected stable:RHO[:PE])")
    parts = spec[len(VARIANT_PREFIX):].split(":")
    if len(parts) > 2:
        raise ValueError(f"unknown DSA model variant {spec!r} (expected stable:RHO[:PE])")
    rho = float(parts[0])
    pe = float(parts[1]) if len(parts) > 1 else 1.0
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"stable:RHO needs 0 <= RHO < 1, got {rho}")
    if not 0.0 < pe <= 1.0:
        raise ValueError(f"stable:RHO:PE needs 0 < PE <= 1, got {pe}")
    return rho, pe


def variant_name(rho: float, pe: float = 1.0) -> str:
    return f"stable:{rho:g}" + (f":{pe:g}" if pe != 1.0 else "")


def variant_dir(src: str | Path, rho: float, pe: float = 1.0) -> Path:
    src = Path(src)
    return src.parent / (f"{src.name}-stable{rho:g}" + (f"-pe{pe:g}" if pe != 1.0 else ""))


def build_variant(src: str | Path, rho: float, pe: float = 1.0, out: str | Path | None = None,
                  seed: int = 1234) -> Path:
    """Write the ``stable:RHO[:PE]`` variant of the model directory ``src`` (see the module
    doc); reuses ``out`` when it already holds this variant of this source."""
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(src)
    out = Path(out) if out is not None else variant_dir(src, rho, pe)
    cfg = json.loads((src / "config.json").read_text())
    rope = int(cfg["qk_rope_head_dim"])
    tensors = load_file(str(src / WEIGHTS))
    knorm = sorted(k for k in tensors if ".self_attn.indexer.k_norm." in k) if pe != 1.0 else []
    info = {"variant": variant_name(rho, pe), "rho": rho, "pe": pe, "seed": seed,
            "source": str(src), "changed": [EMBED] + knorm,
            "source_build": _read_json(src / BUILD_INFO)}
    if (out / BUILD_INFO).exists() and _read_json(out / BUILD_INFO) == info:
        return out
    emb = tensors[EMBED]
    e = emb.float()
    norms = e.norm(dim=1, keepdim=True)
    gen = torch.Generator().manual_seed(seed)
    e0 = torch.randn(e.shape[1], generator=gen)
    e0 = e0 / e0.norm()
    mixed = (rho ** 0.5) * e0 * norms + ((1.0 - rho) ** 0.5) * e
    mixed = mixed * (norms / mixed.norm(dim=1, keepdim=True).clamp_min(1e-12))
    tensors[EMBED] = mixed.to(emb.dtype)
    for k in knorm:  # the indexer key's RoPE half (its first qk_rope_head_dim entries)
        t = tensors[k].float()
        t[:rope] *= pe
        tensors[k] = t.to(tensors[k].dtype)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in (WEIGHTS, BUILD_INFO):
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(tmp / WEIGHTS),
              metadata={"format": "pt"})
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _read_json(p: Path):
    return json.loads(p.read_text()) if p.exists() else None


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def overlap_from_trace(path: str | Path, topk: int) -> dict:
    """Step-to-step top-k overlap per request and layer group (module doc)."""
    sel: dict[tuple[int, int], dict[int, list[int]]] = {}  # (step, group) -> req -> addrs
    with open(path) as f:
        next(f, None)  # header: {"num_logical": ...}
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") != "select":
                continue
            reqs = rec["req"]
            per = sel.setdefault((rec["step"], rec["group"]), {})
            if not isinstance(reqs, list):
                reqs = [reqs] * len(rec["addr"])
            for r, a in zip(reqs, rec["addr"]):
                per.setdefault(r, []).append(a)
    # decode selections only: one query token per request selects at most topk addresses
    prev: dict[tuple[int, int], tuple[int, set]] = {}  # (group, req) -> (step, set)
    vals: list[float] = []
    by_group: dict[int, list[float]] = {}
    decode_samples = 0
    for (step, g) in sorted(sel):
        for r, addrs in sel[(step, g)].items():
            key = (g, r)
            if len(addrs) > topk:  # a prefill chunk for this request
                prev.pop(key, None)
                continue
            cur = set(addrs)
            decode_samples += 1
            p = prev.get(key)
            if p is not None and p[0] == step - 1 and cur:
                v = len(cur & p[1]) / len(cur)
                vals.append(v)
                by_group.setdefault(g, []).append(v)
            prev[key] = (step, cur)
    if not vals:
        return {"samples": 0, "decode_selections": decode_samples}
    return {"mean": statistics.fmean(vals), "median": statistics.median(vals),
            "p10": _quantile(vals, 0.1), "p90": _quantile(vals, 0.9), "samples": len(vals),
            "decode_selections": decode_samples,
            "mean_by_group": {str(g): statistics.fmean(v) for g, v in sorted(by_group.items())},
            "definition": "per request and layer group: |S_t & S_(t-1)| / |S_t| over "
                          "consecutive decode steps (S: the indexer's selected logical "
                          "addresses, from ulacache's selection trace)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write a stable:RHO variant")
    b.add_argument("--rho", type=float, required=True)
    b.add_argument("--pe", type=float, default=1.0)
    b.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / "models_cache"
                                        / "bench-deepseek-v32"))
    b.add_argument("--out", default=None)
    o = sub.add_parser("overlap", help="step-to-step top-k overlap of a selection trace")
    o.add_argument("trace")
    o.add_argument("--topk", type=int, default=16)
    a = ap.parse_args()
    if a.cmd == "build":
        print(build_variant(a.src, a.rho, a.pe, a.out))
    else:
        print(json.dumps(overlap_from_trace(a.trace, a.topk), indent=1))


if __name__ == "__main__":
    main()
