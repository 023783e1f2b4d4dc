"""Text and JSON renderings of plans: a markdown table per cluster, the assumptions under it,
and the cross-cluster gain line. Rendering only; every number comes from the Plan."""
from __future__ import annotations

from typing import Any

from .capacity import GIB, Plan


def _fmt_int(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _fmt_gain(plan: Plan, key: str) -> str:
    if key == plan.base_key:
        return "1.0x"
    ratio, extra = plan.gain(key)
    if ratio is None:
        return "-"
    return f"{ratio:.1f}x ({extra:+,})" if ratio != float("inf") else f"inf ({extra:+,})"


def table(plan: Plan) -> str:
    m, cl = plan.model, plan.cluster
    lines = [
        (f"### {m.name} on {cl.name}: {cl.gpus} GPUs = DP {cl.dp} x TP {cl.tp}, requests of "
         f"{plan.request_tokens:,} tokens, KV {plan.kv_dtype}, "
         f"KV budget {plan.kv_budget / GIB:.1f} GiB/GPU, host {cl.host_gib_per_gpu:g} GiB/GPU"),
        "",
        ("| scheme | KV tokens / engine | requests / engine | requests / cluster | vs stock "
         "| host GiB/GPU used | notes |"),
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in plan.rows:
        if r.error:
            lines.append(f"| {r.label} | - | - | - | - | - | {r.error} |")
            continue
        lines.append(
            f"| {r.label} | {_fmt_int(r.tokens)} | {_fmt_int(r.requests)} | "
            f"{_fmt_int(r.cluster_requests)} | {_fmt_gain(plan, r.key)} | "
            f"{r.host_bytes / GIB:.1f} | {r.note} |")
    return "\n".join(lines)


def assumptions(plan: Plan) -> str:
    return "Assumptions:\n" + "\n".join(f"- {a}" for a in plan.assumptions)


def comparison(plans: list[Plan]) -> str:
    """One line per DSA scheme: its gain over stock on each cluster (ratio and extra requests)."""
    if len(plans) < 2 or plans[0].model.kind != "dsa":
        return ""
    out = ["Gain over stock vLLM, cluster-wide (ratio, extra concurrent requests):"]
    for key in ("hisparse_per_rank", "hisparse_shared", "ulacache_dp", "ulacache_shard"):
        parts = []
        for p in plans:
            ratio, extra = p.gain(key)
            parts.append(f"{p.cluster.name} " + ("-" if ratio is None else
                                                 f"{ratio:.1f}x ({extra:+,})"))
        out.append(f"- {plans[0].row(key).label}: " + "; ".join(parts))
    return "\n".join(out)


def render(plans: list[Plan]) -> str:
    blocks = []
    for p in plans:
        blocks.append(table(p))
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
            "rows": [{"key": r.key, "label": r.label, "tokens_per_engine": r.tokens,
                      "requests_per_engine": r.requests,
                      "requests_per_cluster": r.cluster_requests,
                      "host_bytes_per_gpu": r.host_bytes,
                      "ula_host_pool_gib": r.host_pool_gib, "note": r.note, "error": r.error}
                     for r in p.rows],
            "assumptions": p.assumptions,
        })
    return out
