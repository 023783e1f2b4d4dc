#!/usr/bin/env python3
"""The CUDA glue's runtime (`CudaRows`, ``ulacache_vllm/engine/dsa/cuda/runtime.py``) on one
device, for a GPU with torch and Triton but no vLLM (`CudaRows` imports no vLLM; vLLM's
FlashMLA classes around it are what this cannot reach).

A small serving loop drives the real step contract: each step registers the new tokens' logical
slots (`register_writes`), runs `begin_step` (frees, settle of the last step's logged misses,
round, assign + write translation into the static slot-mapping buffers), writes the tokens'
byte rows at the translated rows (as vLLM's fused write kernel would), then, for every layer,
resolves and stages a random top-k over the live tokens (`resolve_stage`, in the token chunks
`chunks` gives when a call is larger than staging) and reads the rows from ``kv_view``. Every
selected row's bytes must equal what was written for that logical slot, on every layer of
every step, while the device pool holds a fraction of the live tokens (demotions to the pinned
host pool, promotions back, host rows staged through its UVA view), calls larger than staging
run chunked, and requests finish (frees). On CUDA the host pools are pinned at exact size
(`pin_exact`); ``--device cpu`` runs the same loop on the CPU (Triton interpreter).

Prints a summary and writes JSON (``--out``; default ``$OUT/gpu_runtime_check.json`` when
``$OUT`` is set). Exit 0 when every read matched and every path ran (promotions, demotions,
staged rows, chunked calls > 0; no overflow), 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="smaller sizes")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON output path")
    return p.parse_args(argv)


def _load_kernel_check():
    spec = importlib.util.spec_from_file_location("_gpu_kernel_check",
                                                  REPO / "scripts" / "gpu_kernel_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(dev, quick: bool, steps: int | None, row_bytes: int, seed: int) -> dict:
    import torch

    from ulacache_vllm.engine.dsa.cuda.runtime import CudaRows

    B = 16 if quick else 64  # block size (64: the fp8 kernel's pages on CUDA)
    K = 32 if quick else 2048  # top-k per token
    reqs = 4 if quick else 16  # concurrent requests
    prompt = 4 * B if quick else 8 * B
    steps = steps or (6 if quick else 12)
    decode = 2  # tokens per request per decode step (a draft + the verified token)
    groups = [["l0", "l1"], ["l2"]]
    layers = [n for g in groups for n in g]
    # Tokens live at the peak: requests x (prompt + steps x decode); the device pool holds
    # about a third of them per layer (at least one step's writes), the host pool the rest.
    peak = reqs * (prompt + steps * decode)
    blocks_per_req = -(-(prompt + steps * decode) // B) + 1
    num_logical = 2 * reqs * blocks_per_req * B
    admit = 2  # prefills per step: a step's writes fit the device pool (as the sizing ensures)
    P = -(-max(peak // 3, admit * prompt + reqs * decode) // B) * B
    H = 4 * peak
    # Staging for a few tokens' selections, below the host pool's rows: prefill calls (and wide
    # decode calls) run chunked.
    S = (2 if quick else 16) * K
    assert S < H
    g = torch.Generator().manual_seed(seed)
    rows = CudaRows(groups, row_bytes=row_bytes, head_size=row_bytes // 2,
                    kv_dtype=torch.uint8, block_size=B, device_slots=P, host_slots=H,
                    staging_rows=S, num_logical=num_logical,
                    max_tokens=admit * prompt + reqs * decode,
                    device=dev)
    truth = {n: torch.zeros(num_logical, row_bytes, dtype=torch.uint8, device=dev)
             for n in layers}
    free_blocks = list(range(num_logical // B))
    live: list[dict] = []  # requests: blocks, length
    res = {"row_bytes": row_bytes, "block": B, "K": K, "P": P, "H": H, "S": S,
           "reads": 0, "bad_reads": 0, "steps": 0, "freed_blocks": 0,
           "begin_step_ms": [], "layer_call_ms": []}

    def slots_of(r, t0, t1):
        pos = torch.arange(t0, t1)
        blocks = torch.tensor(r["blocks"], dtype=torch.int64)
        return blocks[pos // B] * B + pos % B

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    next_id = 0
    for step in range(steps):
        freed = []
        # Finish the oldest request every third step; admit new ones up to `reqs`.
        if step and step % 3 == 0 and live:
            done = live.pop(0)
            freed = done["blocks"]
            free_blocks.extend(freed)
            res["freed_blocks"] += len(freed)
        new_slots, spans = [], []
        for r in live:  # decode: `decode` new tokens each
            need = -(-(r["len"] + decode) // B)
            while len(r["blocks"]) < need:
                r["blocks"].append(free_blocks.pop(0))
            spans.append((r, r["len"], r["len"] + decode))
        for _ in range(min(admit, reqs - len(live))):  # prefill
            r = {"id": next_id, "blocks": [], "len": 0}
            next_id += 1
            for _ in range(-(-prompt // B)):
                r["blocks"].append(free_blocks.pop(0))
            live.append(r)
            spans.append((r, 0, prompt))
        for r, t0, t1 in spans:
            new_slots.append(slots_of(r, t0, t1))
        sm = torch.cat(new_slots).to(dev)
        for n in layers:
            rows.register_writes(n, sm)
        freed_addrs = None
        if freed:
            b = torch.tensor(freed, dtype=torch.int64, device=dev)
            freed_addrs = (b.unsqueeze(1) * B + torch.arange(B, device=dev)).reshape(-1)
        sync()
        t = time.perf_counter()
        rows.begin_step(freed_addrs)
        sync()
        res["begin_step_ms"].append(round((time.perf_counter() - t) * 1e3, 3))
        # The fused write kernel: the new tokens' bytes at the translated rows of each layer.
        for n in layers:
            data = torch.randint(0, 256, (sm.numel(), row_bytes), generator=g,
                                 dtype=torch.uint8).to(dev)
            truth[n].index_copy_(0, sm, data)
            rows.buf.index_copy_(0, rows.write_rows[n][: sm.numel()], data)
        for r, _, t1 in spans:
            r["len"] = t1
        # The step's queries: every new token selects up to K of its request's tokens.
        T = sum(t1 - t0 for _, t0, t1 in spans)
        topk = torch.full((T, K), -1, dtype=torch.int64)
        row = 0
        for r, t0, t1 in spans:  # (a test tool's setup loop, not a product path)
            sl = slots_of(r, 0, r["len"])
            for t in range(t0, t1):
                n_sel = min(K, t + 1)
                topk[row, :n_sel] = sl[torch.randperm(t + 1, generator=g)[:n_sel]]
                row += 1
        topk[::3, :3] = topk[::3, 3:4]  # duplicates within a token
        topk_d = topk.to(dev)
        for n in layers:
            sync()
            t = time.perf_counter()
            got = []
            for ci, (c0, c1) in enumerate(rows.chunks(T, K)):
                rr = rows.resolve_stage(n, topk_d[c0:c1], carry=ci > 0)
                view = rows.kv_view(n).reshape(-1, row_bytes)
                got.append((c0, c1, view.index_select(0, rr.reshape(-1).clamp(min=0).long())
                            .view(c1 - c0, K, row_bytes).clone()))
            sync()
            res["layer_call_ms"].append(round((time.perf_counter() - t) * 1e3, 3))
            for c0, c1, by in got:
                sel = topk_d[c0:c1]
                ok = sel >= 0
                want = truth[n].index_select(0, sel.clamp(min=0).reshape(-1)).view_as(by)
                bad = (by != want).any(-1) & ok
                res["reads"] += int(ok.sum())
                res["bad_reads"] += int(bad.sum())
        res["steps"] += 1
    rows.begin_step(None)  # settles the last step's misses; raises on an overflow
    res["counters"] = {k: int(v) for k, v in rows.counters.items()}
    c = res["counters"]
    res["ok"] = (res["bad_reads"] == 0 and res["reads"] > 0 and c["promotions"] > 0
                 and c["demotions"] > 0 and c["staged"] > 0 and c.get("chunked_calls", 0) > 0
                 and c.get("overflow", 0) == 0 and res["freed_blocks"] > 0)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # this process only, before Triton loads
    how = _load_kernel_check()._import_package()
    dev = torch.device(dev_name)
    t0 = time.perf_counter()
    out = {"env": {"device": str(dev), "python": platform.python_version(),
                   "torch": torch.__version__, "package": how, "quick": args.quick,
                   "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None},
           "runs": []}
    print(f"gpu_runtime_check on {dev} ({out['env']['gpu'] or 'CPU'}); package: {how}",
          flush=True)
    for i, rb in enumerate((656, 1152)):
        r = run(dev, args.quick, args.steps, rb, seed=i)
        out["runs"].append(r)
        c = r["counters"]
        bs = sorted(r["begin_step_ms"])
        lc = sorted(r["layer_call_ms"])
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} row={rb} steps={r['steps']} reads={r['reads']} "
              f"bad={r['bad_reads']} promotions={c['promotions']} demotions={c['demotions']} "
              f"staged={c['staged']} chunked_calls={c.get('chunked_calls')} "
              f"chunks={c.get('attention_chunks')} fallback={c['fallback_chunks']} "
              f"overflow={c.get('overflow')} freed_blocks={r['freed_blocks']} "
              f"begin_step_ms_median={bs[len(bs) // 2]} layer_call_ms_median={lc[len(lc) // 2]}",
              flush=True)
    out["ok"] = all(r["ok"] for r in out["runs"])
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    if "vllm" in sys.modules:
        out["ok"] = False
        print("FAIL: vllm was imported", flush=True)
    path = args.out or (os.path.join(os.environ["OUT"], "gpu_runtime_check.json")
                        if os.environ.get("OUT") else "gpu_runtime_check.json")
    Path(path).write_text(json.dumps(out, indent=1))
    print(f"JSON: {path}; overall: {'PASS' if out['ok'] else 'FAIL'} ({out['wall_s']} s)")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
