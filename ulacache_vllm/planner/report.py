"""Text and JSON renderings of plans: a markdown table per cluster, the assumptions under it,
and the cross-cluster gain line. Rendering only; every number comes from the Plan."""
from __future__ import annotations

from typing import Any

from .budget import GIB
from .records import ULA_KEYS, Plan, Row
from .v4_report import detail_json, sections


def _fmt_int(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _fmt_gain(plan: Plan, key: str, base: str) -> str:
    if key == base:
        return "1.0x"
    ratio, extra = plan.gain(key, base)
    if ratio is None:
        return "-"
    return f"{ratio:.1f}x ({extra:+,})" if ratio != float("inf") else f"inf ({extra:+,})"


def _engines(r: Row) -> str:
    return "-" if r.tp is None else f"{r.dp} x TP {r.tp}"


def table(plan: Plan) -> str:
    m, cl = plan.model, plan.cluster
    anchor, base = plan.anchor_key, plan.base_key
    lines = [
        (f"### {m.name} on {cl.name}: {cl.gpus} GPUs = DP {cl.dp} x TP {cl.tp}, requests of "
         f"{plan.request_tokens:,} tokens, KV {plan.kv_dtype}, "
         f"KV budget {plan.kv_budget / GIB:.1f} GiB/GPU, host {cl.host_gib_per_gpu:g} GiB/GPU"),
        "",
        (f"Multiples are requests that fit, not throughput. \"best vLLM\": the vLLM 0.32 row "
         f"holding the most requests, here {plan.row(anchor).label}."),
        "",
        ("| scheme | engines | KV tokens / engine | requests / engine | requests / cluster "
         "| vs best vLLM | vs stock | host GiB/GPU used | notes |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in plan.rows:
        if r.error:
            lines.append(f"| {r.label} | - | - | - | - | - | - | - | {r.error} |")
            continue
        lines.append(
            f"| {r.label} | {_engines(r)} | {_fmt_int(r.tokens)} | {_fmt_int(r.requests)} | "
            f"{_fmt_int(r.cluster_requests)} | {_fmt_gain(plan, r.key, anchor)} | "
            f"{_fmt_gain(plan, r.key, base)} | {r.host_bytes / GIB:.1f} | {r.note} |")
    return "\n".join(lines)


def assumptions(plan: Plan) -> str:
    return "Assumptions:\n" + "\n".join(f"- {a}" for a in plan.assumptions)


def comparison(plans: list[Plan]) -> str:
    """Per ulacache row, its multiple over the strongest vLLM row, over vLLM 0.32's HiSparse
    with one host pool per node, and over stock, on each cluster (DSA plans)."""
    if not plans or plans[0].model.kind not in ("dsa", "v4"):
        return ""
    out = ["ulacache against vLLM 0.32, cluster-wide: requests that fit, not throughput "
           "(ratio, extra concurrent requests):"]

    def cell(p: Plan, key: str, base: str) -> str:
        ratio, extra = p.gain(key, base)
        return "-" if ratio is None else f"{ratio:.1f}x ({extra:+,})"

    for key in ULA_KEYS:
        rows = [p.row(key) for p in plans if any(r.key == key for r in p.rows)]
        if not rows or all(r.error for r in rows):
            continue
        parts = []
        for p in plans:
            parts.append(f"{p.cluster.name}: {cell(p, key, p.anchor_key)} vs best vLLM "
                         f"({p.row(p.anchor_key).label}), "
                         f"{cell(p, key, 'hisparse_shared')} vs HiSparse with one host pool "
                         f"per node, {cell(p, key, p.base_key)} vs stock")
        out.append(f"- {rows[0].label}: " + "; ".join(parts))
    return "\n".join(out)


def render(plans: list[Plan]) -> str:
    blocks = []
    for p in plans:
        blocks.append(table(p))
        if p.model.kind == "v4":  # per-kind bytes, physical bound, startup figures, sweep
            blocks.append(sections(p))
        blocks.append(assumptions(p))
    cmp = comparison(plans)
    if cmp:
        blocks.append(cmp)
    return "\n\n".join(blocks) + "\n"


def to_json(plans: list[Plan]) -> list[dict[str, Any]]:
    out = []
    for p in plans:
        out.append({
            "model": p.model.name, "kind": p.model.kind, "cluster": p.cluster.name,
            "gpus": p.cluster.gpus, "tp": p.cluster.tp, "dp": p.cluster.dp,
            "request_tokens": p.request_tokens, "kv_dtype": p.kv_dtype,
            "block_size": p.block_size, "kv_budget_bytes": p.kv_budget,
            "weights_bytes_per_gpu": int(p.weights_per_gpu),
            "anchor_key": p.anchor_key, "base_key": p.base_key,
            "rows": [{"key": r.key, "label": r.label, "tp": r.tp, "dp": r.dp,
                      "tokens_per_engine": r.tokens,
                      "requests_per_engine": r.requests,
                      "requests_per_cluster": r.cluster_requests,
                      "host_bytes_per_gpu": r.host_bytes,
                      "ula_host_pool_gib": r.host_pool_gib, "note": r.note, "error": r.error}
                     for r in p.rows],
            "assumptions": p.assumptions,
        })
        if p.model.kind == "v4":
            out[-1]["v4"] = detail_json(p)
    return out
