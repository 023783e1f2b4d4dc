"""DeepSeek-V4 plans in words: the assumptions printed under the table, the per-kind bytes per
request against stock's padded groups, the physical bound, the startup figures and the host
pool sweep (text and JSON). Rendering only; every number comes from the plan's
``extra`` (``v4.V4Detail``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .assumptions import TAIL, head
from .budget import GIB
from .v4_sizing import PLACEHOLDER, stock_kind_bytes

if TYPE_CHECKING:
    from .records import Plan


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "inf"


def _main(p: Plan):
    det = p.extra
    return det.deployments.get("dp") or det.deployments.get("tp")


def _grows(c) -> str:
    if c.family == "full":
        per = c.row_bytes / c.tokens_per_row
        return f"{c.row_bytes} B per {c.tokens_per_row} tokens ({per:.1f} B a token)"
    return f"bounded: {c.window} tokens x {c.row_bytes:,} B"


def v4_assumptions(p: Plan, experts_over: str) -> list[str]:
    det, cl, L = p.extra, p.cluster, p.request_tokens
    s = det.sched
    by = {c.key: c for c in det.caches}
    out = head(p, experts_over)
    out.append(
        "KV per rank (vLLM 0.32's V4 specs, fp8_ds_mla, every page padded to 576 B, all "
        "replicated over TP ranks: max_tp_shards=1): "
        + "; ".join(f"{c.label} {len(c.layers)} layers, {_grows(c)}, pages of {c.block_size} "
                    f"tokens = {c.page:,} B ({c.raw_page:,} unpadded)" for c in det.caches))
    d = _main(p)
    st = d.stock
    groups = ", ".join(f"{'+'.join(f'{k} x{n}' for k, n in g.kinds.items())} "
                       f"({g.page:,} B)" for g in st.groups)
    out.append(
        f"stock: vLLM 0.32's hybrid allocator, block-outermost layout "
        f"(_get_packed_kv_cache_groups): groups {groups}; every block id is "
        f"{st.stride:,} B, the widest group's. A decoding request holds every block of the "
        f"full group and each sliding group's window + 1 token in flight (cdiv(window, "
        f"block) + 1 blocks: vLLM's SlidingWindowSpec cap at one token); a new request is "
        f"admitted when its capped demand is free (scheduler_reserve_full_isl, vLLM's "
        f"default): sliding groups window - 1 + {s.in_flight_tokens:,} in-flight tokens "
        f"({s.in_flight_batches} batches of max_num_batched_tokens {s.max_num_batched_tokens:,}"
        f": vLLM's async scheduling on GPUs)")
    out.append(
        "requests: the most of the given length that are each admitted and all run to full "
        "length, 1 + (device pool - one admission) / one request's decoding holdings (the "
        "form of vLLM 0.32's HiSparse steady-state concurrency), the same rule for stock "
        "and ulacache; the startup figure in the notes reserves every request's admission "
        "(vLLM's logged get_max_concurrency_for_kv_cache_config, the arena's max_requests)")
    csa, idx = by["csa"], by["idx"]
    line = d.line
    pool = (f"{det.host_gib:g} GiB per GPU (given)" if det.pool_given else
            f"the size that holds the most requests, at most {det.host_gib:g} GiB per GPU "
            f"(every host row keeps its indexer key on the device)")
    out.append(
        f"ulacache: the V4 line (engine/v4, which runs on vLLM's CPU build, one rank: on GPUs "
        f"this is its sizing per rank, not a configuration it starts yet) as computed here "
        f"(the CSA pools' device / host split is this planner's arithmetic, not the engine's "
        f"--ula-v4-csa-device-rows default): CSA rows in the logical address space, "
        f"{csa.row_bytes} B a row per CSA layer without page padding ([rows, {csa.row_bytes}] "
        f"pool views), device pool + host pool with exclusive residency, the device pool at "
        f"least one step's new rows + "
        f"index_topk ({line.need_blocks} blocks of {csa.block_size} tokens); host pool "
        f"{pool}; indexer keys on the device for every logical row (device and host) at "
        f"vLLM's page ({idx.page:,} B per {idx.block_size} tokens per layer) plus a "
        f"{PLACEHOLDER} B placeholder per row per CSA layer (the DSA line's placeholder spec); "
        f"window, HCA and compressor states in the arena, one page per kind holding all its "
        f"layers (engine.arena.sizing: {line.alignment} B alignment, a null page and the "
        f"largest page's view slack), the same admission gate and window frees as stock; TP "
        f"engines replicate (every rank holds everything, its own host pool)")
    out.append(
        "physical bound: the device budget over the bytes of data a request keeps on the "
        "device once its CSA rows live on the host (indexer keys, HCA rows, the window, the "
        "compressor states; no pages, no admission reserve)")
    out.append(
        f"best vLLM: the stock row (TP-{cl.tp} engines or DP engines) holding the most "
        f"requests cluster-wide; the HiSparse rows carry vLLM 0.32's refusal of V4")
    if det.checked:
        out.append("checked against vLLM 0.32 and the engine, equal: " + "; ".join(det.checked))
    out.append(f"scheduler: max_num_batched_tokens {cl.max_num_batched_tokens}, max_num_seqs "
               f"{cl.max_num_seqs} (a count above it needs --max-num-seqs raised), chunked "
               f"prefill on; prefix caching off (not modelled); requests of {L} tokens")
    out.append(TAIL + "; for ulacache also the CUDA staging of host rows read by the top-512 "
                      "and the PCIe traffic of those reads")
    return out


def kinds_table(p: Plan) -> str:
    d = _main(p)
    L, line, det = p.request_tokens, d.line, p.extra
    stock = stock_kind_bytes(d.stock, L)
    kinds = {k.cache.key: k for k in line.kinds}
    rows = [f"#### DeepSeek-V4 KV per request of {L:,} tokens, one rank (ulacache against "
            f"stock's padded groups)", "",
            "| cache | layers | ulacache home | page (vLLM) | resident pages | data | stock "
            "(padded blocks) | ulacache |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    dev_u = 0
    for c in det.caches:
        if c.key == "csa":
            ula, home = line.csa_request_bytes, "logical space (device or host pool)"
        elif c.key == "idx":
            ula, home = line.blocks_per_request * len(c.layers) * c.page, "device"
            dev_u += ula
        else:
            ula, home = line.kind_bytes(kinds[c.key]), f"arena ({kinds[c.key].page:,} B pages)"
            dev_u += ula
        rows.append(f"| {c.label} | {len(c.layers)} | {home} | {c.page:,} B / {c.block_size} "
                    f"tok | {c.resident_pages(L):,} | {_mb(c.exact_bytes(L))} | "
                    f"{_mb(stock.get(c.key, 0))} | {_mb(ula)} |")
    ph = line.blocks_per_request * line.csa_layers * line.block_rows * PLACEHOLDER
    rows.append(f"| CSA placeholders ({PLACEHOLDER} B per row per layer) | "
                f"{line.csa_layers} | device | - | - | - | - | {_mb(ph)} |")
    st = d.stock
    rows.append(f"| **device, a decoding request** | | | | | | "
                f"**{_mb(st.resident_blocks * st.stride)}** | **{_mb(dev_u + ph)}** "
                f"+ CSA rows {_mb(line.csa_request_bytes)} |")
    rows += ["", "| stock group (vLLM) | layers | block payload | block stride | padding | "
                 "blocks / decoding request | bytes / request | blocks / admission |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    s = det.sched
    for g in st.groups:
        kinds_ = "+".join(f"{k} x{n}" for k, n in g.kinds.items())
        blocks = g.first.resident_pages(L)
        rows.append(f"| {kinds_} | {len(g.members)} | {g.page:,} B | {st.stride:,} B | "
                    f"{st.stride / g.page - 1:+.0%} | {blocks:,} | {_mb(blocks * st.stride)} | "
                    f"{g.first.admission_pages(L, s.in_flight_tokens):,} |")
    return "\n".join(rows)


def summary(p: Plan) -> str:
    det, L = p.extra, p.request_tokens
    out = [f"DeepSeek-V4 at {L:,}-token requests (requests that fit, not throughput):"]
    best = {}
    for key, d in det.deployments.items():
        cl, st, u = d.plan.cluster, d.stock, d.ula
        name = f"{cl.dp} x TP {cl.tp}"
        best[key] = (st.steady * cl.dp, u.requests * cl.dp)
        out.append(
            f"- {name} ({d.plan.kv_budget / GIB:.1f} GiB KV per GPU): stock {st.steady:,} per "
            f"engine ({st.steady * cl.dp:,} cluster-wide), ulacache {u.requests:,} "
            f"({u.requests * cl.dp:,}): **{_ratio(u.requests, st.steady)} at equal device "
            f"memory** with {u.host_bytes / GIB:.1f} GiB per GPU of host pool; physical bound "
            f"{d.bound:,} per engine (ulacache at {u.requests / max(1, d.bound):.2f} of it); "
            f"startup figures (every request at its admission reserve): stock "
            f"{st.reserve:.1f}, ulacache {d.ula_reserve.requests} "
            f"({_ratio(d.ula_reserve.requests, st.reserve)})")
        sweep = ", ".join(f"{g:g} GiB: {n:,} ({_ratio(n, st.steady)})" for g, n in d.sweep)
        out.append(f"  - host pool per GPU -> ulacache requests per engine (vs stock): {sweep}")
        ex = d.exact
        out.append(f"  - physical bound: {ex / L:,.0f} device bytes per token once the CSA rows "
                   f"live on the host ({_mb(ex)} a request), against stock's "
                   f"{st.resident_blocks * st.stride / L:,.0f} B and ulacache's "
                   f"{d.line.device_request_bytes / L:,.0f} B (+ "
                   f"{d.line.csa_request_bytes / L:,.0f} B of CSA rows in the logical space)")
    if best:
        bv = max(v[0] for v in best.values())
        bu = max(v[1] for v in best.values())
        out.append(f"- best ulacache {bu:,} against best vLLM (stock) {bv:,} cluster-wide: "
                   f"**{_ratio(bu, bv)}**")
    return "\n".join(out)


def sections(p: Plan) -> str:
    return kinds_table(p) + "\n\n" + summary(p)


def detail_json(p: Plan) -> dict[str, Any]:
    det, L = p.extra, p.request_tokens
    out: dict[str, Any] = {
        "caches": [{"key": c.key, "label": c.label, "layers": len(c.layers),
                    "block_tokens": c.block_size, "row_bytes": c.row_bytes,
                    "tokens_per_row": c.tokens_per_row, "window": c.window,
                    "page_bytes": c.page, "unpadded_page_bytes": c.raw_page,
                    "resident_pages": c.resident_pages(L), "data_bytes": c.exact_bytes(L),
                    "ulacache_home": c.home} for c in det.caches],
        "in_flight_tokens": det.sched.in_flight_tokens, "checked": det.checked,
        "deployments": {}}
    for key, d in det.deployments.items():
        st, u, line = d.stock, d.ula, d.line
        out["deployments"][key] = {
            "tp": d.plan.cluster.tp, "dp": d.plan.cluster.dp,
            "kv_budget_bytes": d.plan.kv_budget,
            "stock": {"requests": st.steady, "startup_figure": st.reserve,
                      "block_stride": st.stride, "usable_blocks": st.usable_blocks,
                      "resident_blocks": st.resident_blocks,
                      "admission_blocks": st.admission_blocks,
                      "groups": [{"kinds": dict(g.kinds), "block_payload": g.page,
                                  "resident_blocks": g.first.resident_pages(L)}
                                 for g in st.groups],
                      "kind_bytes": stock_kind_bytes(st, L)},
            "ulacache": {"requests": u.requests, "startup_figure": d.ula_reserve.requests,
                         "device_blocks": u.device_blocks, "host_blocks": u.host_blocks,
                         "host_pool_bytes": u.host_bytes,
                         "device_bytes_per_request": line.device_request_bytes,
                         "csa_bytes_per_request": line.csa_request_bytes,
                         "arena_alignment": line.alignment,
                         "arena_bytes_per_request": {k.cache.key: line.kind_bytes(k)
                                                     for k in line.kinds}},
            "physical_bound": {"requests": d.bound, "device_bytes_per_request": d.exact,
                               "device_bytes_per_token": d.exact / L},
            "ratio_ulacache_over_stock": u.requests / st.steady if st.steady else None,
            "host_pool_sweep": [{"host_gib_per_gpu": g, "requests": n} for g, n in d.sweep]}
    return out
