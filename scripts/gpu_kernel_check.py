#!/usr/bin/env python3
"""Kernel check for a GPU with torch and Triton but no vLLM (issue 33, item 3).

Checks ulacache's in-forward kernels (``kernels/resolve_kernels.py``: resolve, stage, write
translation; the PB-LRU hit + touch of ``kernels/pblru_kernels.py``) on one device:

1. parity: Triton against the torch references on the device, byte-exact per (token, k) for
   656 B (fp8_ds_mla) and 1152 B (bf16) rows; the same misses (addresses and host slots), the
   same labels and counts; duplicates, -1 padding, padded batch rows, the identity flag, a
   staging overflow;
2. UVA: a pinned host pool (``--host-pool-gib``, default 8 on CUDA; pinned at exact size by
   ``cudaHostRegister`` when torch exposes it), read by the stage kernel through
   ``kernels.host_view``, and the random-row gather bandwidth (stage kernel, torch
   ``index_select`` over the view, a device-to-device gather and a bulk pinned copy as yardsticks);
3. graphs: write-translate -> byte-row write -> resolve -> stage -> a reference attention
   (torch softmax attention over the gathered rows, decoded from bf16 or fp8_ds_mla bytes)
   captured in one CUDA graph per T; between replays a real ``TieredMapping`` settles the
   logged misses (``ensure_resident`` + ``apply`` with stream-ordered GPU copies, host rows
   through the UVA view), assigns the step's new addresses (demotions) and frees others; every
   replay's gathered bytes and attention output must be bit-equal to an eager reference over
   an unpaged copy of every row; the last replay flips the identity flag;
4. timings: resolve + stage per layer at 0 / 1 / 10 / 100 % misses, and the settle's
   bookkeeping (``ensure_resident`` + commit, copies left out) on the device's tensors with 1k
   and 10k misses.

It prints a table and writes JSON (``--out``; default ``$OUT/gpu_kernel_check.json`` when
``$OUT`` is set, else ``./gpu_kernel_check.json``). ``--device cpu`` runs the same checks on
the CPU with Triton's interpreter (it sets ``TRITON_INTERPRET=1`` for its own process when
unset) and small sizes; graph capture is skipped there (the same pipeline runs eagerly) and
the timings are of the CPU path (the references), not of any kernel a GPU would run.
``--quick`` shrinks every size further (the test suite runs ``--device cpu --quick``).

It imports ``ulacache_vllm.kernels`` and ``ulacache_vllm.core`` (neither imports vLLM). Where
the package is not installed (a bare GPU image), it loads them from this checkout: the repo
root on ``sys.path`` and ``kernels/`` registered as ``ulacache_vllm.kernels``.

Run on a lent GPU from the repo root:
``python3 scripts/gpu_kernel_check.py --out $OUT/gpu_kernel_check.json`` (a few minutes).
Exit status 0 when every check passed, 1 otherwise. It does not check vLLM's kernels, the
engine glue, end-to-end serving or anything about throughput beyond these kernels.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FP8_ROW, BF16_ROW = 656, 1152


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="smaller sizes everywhere")
    p.add_argument("--host-pool-gib", type=float, default=None,
                   help="pinned host pool size (default 8 on CUDA, 0.02 on CPU)")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--skip", default="", help="comma list of sections to skip: "
                   "parity,uva,graphs,timings")
    return p.parse_args(argv)


def _import_package():
    """``ulacache_vllm.kernels`` and ``ulacache_vllm.core``, from the install or this checkout."""
    try:
        import ulacache_vllm.kernels  # noqa: F401  (installed: kernels/ mapped by setup.cfg)
        how = "installed package"
    except ImportError:
        sys.path.insert(0, str(REPO))
        for m in [m for m in sys.modules if m == "ulacache_vllm" or m.startswith("ulacache_vllm.")]:
            del sys.modules[m]
        import ulacache_vllm

        spec = importlib.util.spec_from_file_location(
            "ulacache_vllm.kernels", REPO / "kernels" / "__init__.py",
            submodule_search_locations=[str(REPO / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["ulacache_vllm.kernels"] = mod
        spec.loader.exec_module(mod)
        ulacache_vllm.kernels = mod
        how = f"checkout shim ({REPO})"
    import ulacache_vllm.core  # noqa: F401

    if "vllm" in sys.modules:
        raise RuntimeError("ulacache_vllm.kernels/core imported vllm: this check runs without it")
    return how


class Report:
    def __init__(self):
        self.data = {"parity": [], "uva": {}, "graphs": {}, "timings": {}, "notes": []}

    def parity(self, name, ok, **detail):
        self.data["parity"].append({"name": name, "ok": bool(ok), **detail})
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {_fmt(detail)}", flush=True)

    def note(self, msg):
        self.data["notes"].append(msg)
        print(f"  note: {msg}", flush=True)


def _fmt(d):
    return " ".join(f"{k}={v}" for k, v in d.items()) if d else ""


# ------------------------------------------------------------------------------------- setup
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # noqa: F401  (before the device guess)

    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # This process only (before Triton is imported): the kernels run interpreted.
        os.environ["TRITON_INTERPRET"] = "1"
    how = _import_package()
    import triton

    from ulacache_vllm import kernels as K

    dev = torch.device(dev_name)
    if dev.type == "cuda":
        torch.cuda.init()
    rep = Report()
    d = rep.data
    d["env"] = {"device": str(dev), "python": platform.python_version(), "torch": torch.__version__,
                "triton": triton.__version__, "package": how, "quick": args.quick,
                "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}
    print(f"gpu_kernel_check on {dev} ({d['env']['gpu'] or 'CPU, Triton interpreter'}); "
          f"torch {torch.__version__}, triton {triton.__version__}; package: {how}", flush=True)
    tk = importlib.import_module("ulacache_vllm.kernels.resolve_kernels")
    ctx = Ctx(args, dev, K, tk, rep)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    sections = [("uva", ctx.host_pool_setup), ("parity", ctx.parity),
                ("uva", ctx.uva_bandwidth), ("graphs", ctx.graphs), ("timings", ctx.timings)]
    for name, fn in sections:
        if name in skip and fn is not ctx.host_pool_setup:
            rep.note(f"section {name} skipped (--skip)")
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (a section's crash is a failed check, reported)
            import traceback

            traceback.print_exc()
            rep.parity(f"{name}: {fn.__name__} raised", False, error=repr(e)[:500])
        d.setdefault("section_s", {})[fn.__name__] = round(time.perf_counter() - t, 2)
    d["wall_s"] = round(time.perf_counter() - t0, 2)
    d["parity_ok"] = all(c["ok"] for c in d["parity"]) and bool(d["parity"])
    g = d["graphs"]
    d["ok"] = d["parity_ok"] and g.get("ok", True)
    _print_tables(d)
    out = args.out or str(Path(os.environ.get("OUT", ".")) / "gpu_kernel_check.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(d, indent=1, default=str))
    print(f"JSON: {out}; overall: {'PASS' if d['ok'] else 'FAIL'} ({d['wall_s']} s)", flush=True)
    return 0 if d["ok"] else 1


def _print_tables(d):
    print("\n== parity ==")
    for c in d["parity"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}")
    u = d["uva"]
    if u:
        print("\n== UVA ==")
        for k, v in u.items():
            print(f"  {k:34s} {v}")
    g = d["graphs"]
    if g:
        print("\n== graphs ==")
        print(f"  mode: {g.get('mode')}  ok: {g.get('ok')}")
        for r in g.get("runs", []):
            print(f"  T={r['T']:<4} row={r['row_bytes']:<5} replays={r['replays']:<3} "
                  f"bytes_equal={r['bytes_equal']} out_bit_equal={r['out_bit_equal']} "
                  f"misses={r['misses']} promotions={r['promotions']} "
                  f"demotions={r['demotions']}")
    t = d["timings"]
    if t:
        print("\n== timings ==")
        for k, v in t.items():
            print(f"  {k:44s} {v}")


# ------------------------------------------------------------------------------------ checks
class Ctx:
    def __init__(self, args, dev, K, tk, rep):
        import torch

        self.torch = torch
        self.args, self.dev, self.K, self.tk, self.rep = args, dev, K, tk, rep
        self.kref = K.resolve_reference
        self.cuda = dev.type == "cuda"
        q = args.quick
        if self.cuda:
            self.Ts = [1, 8, 64] if q else [1, 8, 64, 256]
            self.Kk = 2048
            # logical / device / host addresses: 4 M / 1 M / 3 M (quick: a quarter)
            self.N, self.D, self.H = ((1 << 20, 1 << 18, 3 << 18) if q
                                      else (4 << 20, 1 << 20, 3 << 20))
            self.graph_Ts = [1, 8] if q else [1, 8, 64]
            self.graph_steps = 4 if q else 6
        else:
            self.Ts = [1, 8] if q else [1, 8, 32]
            self.Kk = 32 if q else 64
            self.N, self.D, self.H = (3000, 1000, 2000) if q else (20000, 6000, 16000)
            self.graph_Ts = [1, 4]
            self.graph_steps = 3
        gib = args.host_pool_gib if args.host_pool_gib is not None else (8.0 if self.cuda else 0.02)
        self.host_bytes = int(gib * (1 << 30))

    def gen(self, seed):
        return self.torch.Generator(device=self.dev).manual_seed(seed)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    # ------------------------------------------------------------------ host pool (UVA)
    def host_pool_setup(self):
        torch, rep = self.torch, self.rep
        n = self.host_bytes
        need = max(self.H * BF16_ROW, self._graph_sizes(max(self.graph_Ts))[2] * BF16_ROW)
        if n < need:
            rep.note(f"host pool raised from {n} to {need} bytes (the parity and graph sizes)")
            n = need
        t = time.perf_counter()
        pinned_how = "plain CPU tensor (no GPU)"
        host = torch.empty(n, dtype=torch.uint8)
        if self.cuda:
            pinned_how = None
            try:
                rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0)
                if _cuda_ok(rc) and host.is_pinned():
                    pinned_how = "cudaHostRegister (exact size)"
            except Exception as e:  # noqa: BLE001
                rep.note(f"cudaHostRegister unavailable ({e!r}); pin_memory() instead")
            if pinned_how is None:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                pinned_how = "pin_memory() (caching host allocator, size rounded up)"
        pin_s = time.perf_counter() - t
        # Random bytes: generated on the device in chunks and copied over (fast), or on CPU.
        g = self.gen(1)
        chunk = 1 << 28
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            host[lo:hi].copy_(torch.randint(0, 256, (hi - lo,), generator=g, dtype=torch.uint8,
                                            device=self.dev))
        self.host_flat = host
        self.hview_flat = self.K.host_view(host, self.dev)
        self.sync()
        from ulacache_vllm.kernels import uva

        self.rep.data["uva"].update({
            "host_pool_bytes": n, "host_pool_gib": round(n / (1 << 30), 3), "pinned": pinned_how,
            "pin_s": round(pin_s, 2),
            "view": uva.VIEW_SOURCE["how"] if self.cuda else "the CPU tensor itself",
            "view_device": str(self.hview_flat.device),
            "view_aliases_host": bool(self.hview_flat.data_ptr() == host.data_ptr())
            if self.cuda else True})
        if self.cuda:  # the view reads the host bytes
            probe = torch.randint(0, n, (4096,), generator=self.gen(2), device=self.dev)
            ok = torch.equal(self.hview_flat[probe].cpu(), host[probe.cpu()])
            rep.parity("uva: device view reads the pinned host bytes", ok)

    def host_rows(self, rb, H=None):
        H = self.H if H is None else H
        return self.hview_flat[:H * rb].view(H, rb)

    # ------------------------------------------------------------------ parity
    def world(self, rb, seed, ident_ok=True):
        torch = self.torch
        g = self.gen(seed)
        N, D, H = self.N, self.D, self.H
        perm = torch.randperm(N, generator=g, device=self.dev)
        nd, nh = min(D, int(0.35 * N)), min(H, int(0.45 * N))
        table = torch.full((N,), -1, dtype=torch.int64, device=self.dev)
        table[perm[:nd]] = torch.randperm(D, generator=g, device=self.dev)[:nd]
        table[perm[nd:nd + nh]] = (1 << 32) | torch.randperm(H, generator=g, device=self.dev)[:nh]
        pool = torch.randint(0, 256, (D, rb), generator=g, dtype=torch.uint8, device=self.dev)
        labels = torch.randint(0, 1000, (D + 1,), generator=g, device=self.dev).to(torch.int16)
        return {"table": table, "pool": pool, "labels": labels, "host": self.host_rows(rb),
                "g": g, "rb": rb}

    def selection(self, w, T, *, dup=True, pad=0.15, below=None):
        torch = self.torch
        g = w["g"]
        hi = below or self.N
        if dup:  # draw from a pool of about half the entries: many duplicates
            cand = torch.randint(0, hi, (max(1, T * self.Kk // 2),), generator=g, device=self.dev)
            sel = cand[torch.randint(0, cand.numel(), (T, self.Kk), generator=g, device=self.dev)]
        else:
            sel = torch.randperm(hi, generator=g, device=self.dev)[:T * self.Kk]
            sel = sel.view(T, -1) if sel.numel() == T * self.Kk else sel.new_full((T, self.Kk), -1)
        return torch.where(torch.rand(T, self.Kk, generator=g, device=self.dev) < pad, -1, sel)

    def run_impl(self, mod, w, logical, ntok, ident, S, rnd=12345):
        torch = self.torch
        st = self.kref.ResolveState(self.N, S, self.dev, for_triton=mod is self.tk)
        labels = w["labels"].clone()
        staging = torch.zeros(S, w["rb"], dtype=torch.uint8, device=self.dev)
        dev_base = S + 1
        rows = mod.resolve(logical, w["table"], labels, torch.tensor([rnd], device=self.dev),
                           torch.tensor([ntok], dtype=torch.int32, device=self.dev),
                           torch.tensor([ident], dtype=torch.int32, device=self.dev), st,
                           dev_base=dev_base)
        mod.stage(w["host"], staging, st.log)
        self.sync()
        return rows, staging, st.log, labels, dev_base

    def gathered_equal(self, a, b, pool):
        """Bytes read per (t, k) equal for two (rows, staging, dev_base) results; chunks of
        tokens bound the memory."""
        torch = self.torch
        (r0, s0, db0), (r1, s1, db1) = a, b
        if not torch.equal(r0 < 0, r1 < 0):
            return False
        T = r0.shape[0]
        step = max(1, (1 << 27) // max(1, r0.shape[1] * pool.shape[1]))
        for lo in range(0, T, step):
            if not torch.equal(self._gather(r0[lo:lo + step], s0, db0, pool),
                               self._gather(r1[lo:lo + step], s1, db1, pool)):
                return False
        return True

    def _gather(self, rows, staging, dev_base, pool):
        torch = self.torch
        r = rows.long()
        S = staging.shape[0]
        from_st = (r >= 0) & (r < S)
        from_dev = r >= dev_base
        a = staging[r.clamp(0, S - 1)]
        b = pool[(r - dev_base).clamp(0, pool.shape[0] - 1)]
        return torch.where(from_st[..., None], a, torch.where(from_dev[..., None], b, 0))

    def parity(self):
        torch, rep = self.torch, self.rep
        print("== parity (Triton vs reference on the device) ==", flush=True)
        seed = 10
        for rb in (FP8_ROW, BF16_ROW):
            w = self.world(rb, seed)
            for T in self.Ts:
                cases = [("dups+pad+padded_rows", dict(dup=True), max(1, T - T // 4), 0, None),
                         ("identity", dict(dup=True, below=self.D), max(1, T - 1), 1, None)]
                if T == self.Ts[-1]:
                    cases += [("unique", dict(dup=False, pad=0.0), T, 0, None),
                              ("staging_overflow", dict(dup=False, pad=0.0), T, 0, 16)]
                for name, sel_kw, ntok, ident, S in cases:
                    seed += 1
                    logical = self.selection(w, T, **sel_kw)
                    S = S or T * self.Kk
                    res = [self.run_impl(m, w, logical, ntok, ident, S)
                           for m in (self.kref, self.tk)]
                    ok, det = self._compare(res, w, logical, S, ntok, ident)
                    rep.parity(f"resolve+stage row={rb} T={T} K={self.Kk} {name}", ok, **det)
            self.parity_write_translate(w)
        self.parity_label_hit_touch()

    def _compare(self, res, w, logical, S, ntok, ident):
        torch = self.torch
        (r0, s0, l0, lab0, db), (r1, s1, l1, lab1, _) = res
        det = {}
        c0, c1 = l0.counts.tolist(), l1.counts.tolist()
        det["misses"], det["unmapped"] = c0[0], c0[1]
        # The distinct host misses among the selected entries of real tokens.
        T = logical.shape[0]
        sel = (torch.arange(T, device=self.dev) < ntok)[:, None] & (logical >= 0)
        v = w["table"][logical.clamp(min=0)]
        exp = torch.unique(logical[sel & (v >> 32 == 1)]) if not ident else logical[:0, 0]
        ok_counts = c0 == c1 and c0[0] == exp.numel()
        n = min(c0[0], S)
        a0, a1 = l0.addr[:n].sort().values, l1.addr[:n].sort().values
        if c0[0] <= S:
            ok_log = torch.equal(a0, exp) and torch.equal(a1, exp)
        else:  # overflow: each logged n distinct misses (which ones is the kernel's order)
            det["overflow"] = c0[0] - S
            ok_log = all(a.unique().numel() == n and bool(torch.isin(a, exp).all())
                         for a in (a0, a1))
        ok_host = (torch.equal(l1.host[:n], w["table"][l1.addr[:n]] & 0xFFFFFFFF)
                   and torch.equal(l0.host[:n], w["table"][l0.addr[:n]] & 0xFFFFFFFF))
        ok_labels = torch.equal(lab0[:-1], lab1[:-1])
        if c0[0] <= S:
            ok_bytes = self.gathered_equal((r0, s0, db), (r1, s1, db), w["pool"])
        else:  # overflowed misses differ by which got a row: compare where both have one
            both = (r0 >= 0) & (r1 >= 0)
            ok_bytes = self.gathered_equal((torch.where(both, r0, -1), s0, db),
                                           (torch.where(both, r1, -1), s1, db), w["pool"])
        # Dedup: one staging row per missed address in the Triton result.
        st = (r1 >= 0) & (r1 < S)
        pairs = torch.unique(logical[st] * (S + 1) + r1[st].long())
        ok_dedup = (torch.unique(r1[st]).numel() == pairs.numel() == n)
        det.update(counts=ok_counts, log=ok_log, host_slots=ok_host, labels=ok_labels,
                   bytes=ok_bytes, dedup=ok_dedup)
        return all(v for k, v in det.items() if isinstance(v, bool)), det

    def parity_write_translate(self, w):
        torch = self.torch
        g = w["g"]
        n = 4096 if self.cuda else 64
        slots = torch.randint(0, self.N, (n,), generator=g, device=self.dev)
        slots = torch.where(torch.rand(n, generator=g, device=self.dev) < 0.1, -1, slots)
        outs = []
        for mod in (self.kref, self.tk):
            for ident in (0, 1):
                err = torch.zeros(1, dtype=torch.int64, device=self.dev)
                s = torch.where(slots >= 0, slots % self.D, -1) if ident else slots
                rows = mod.write_translate(s, w["table"], torch.tensor([ident], device=self.dev),
                                           dev_base=77, trash_row=5, errors=err)
                outs.append((rows, int(err)))
        ok = all(torch.equal(outs[i][0], outs[i + 2][0]) and outs[i][1] == outs[i + 2][1]
                 for i in (0, 1))
        self.rep.parity(f"write_translate row={w['rb']}", ok, errors=outs[0][1])

    def parity_label_hit_touch(self):
        torch = self.torch
        pk = importlib.import_module("ulacache_vllm.kernels.pblru_kernels")
        ref = self.K.reference
        g = self.gen(99)
        S = self.D
        n = min(S, 1 << 16)
        slots = torch.randperm(S, generator=g, device=self.dev)[:n]
        tier = torch.randint(0, 3, (n,), generator=g, device=self.dev)
        loc = torch.where(tier == 2, -1, (tier << 32) | slots)
        lab0 = torch.randint(0, 1000, (S + 1,), generator=g, device=self.dev).to(torch.int16)
        outs = []
        for mod in (ref, pk):
            lab = lab0.clone()
            hit = mod.label_hit_touch(loc, lab, S, 321, torch.full((n,), 321, dtype=torch.int16,
                                                                  device=self.dev))
            outs.append((hit, lab[:S]))
        ok = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        self.rep.parity("pblru label_hit_touch", ok, n=n)

    # ------------------------------------------------------------------ UVA bandwidth
    def uva_bandwidth(self):
        torch = self.torch
        u = self.rep.data["uva"]
        print("== UVA gather ==", flush=True)
        M = (64 * 2048) if self.cuda else 64
        for rb in (FP8_ROW, BF16_ROW):
            H = self.host_bytes // rb if self.host_bytes >= rb else 0
            H = min(H, self.hview_flat.numel() // rb)
            host = self.hview_flat[:H * rb].view(H, rb)
            g = self.gen(7)
            log = self.kref.MissLog(M, self.dev)
            log.host.copy_(torch.randint(0, H, (M,), generator=g, device=self.dev))
            log.counts[0] = M
            staging = torch.empty(M, rb, dtype=torch.uint8, device=self.dev)
            self.tk.stage(host, staging, log)
            self.sync()
            idx = log.host[:min(M, 2048)]
            want = self.host_flat[:H * rb].view(H, rb)[idx.cpu()]
            ok = torch.equal(staging[:idx.numel()].cpu(), want)
            self.rep.parity(f"uva: stage kernel reads random host rows row={rb}", ok,
                            rows=M, pool_rows=H)
            mb = M * rb / 1e6
            t = self._time(lambda: self.tk.stage(host, staging, log))
            u[f"stage_kernel_gather_{rb}B_GBps"] = round(mb / 1e3 / t, 2) if t else None
            u[f"stage_kernel_gather_{rb}B_ms"] = round(t * 1e3, 3)
            t2 = self._time(lambda: torch.index_select(host, 0, log.host, out=staging))
            u[f"torch_index_select_uva_{rb}B_GBps"] = round(mb / 1e3 / t2, 2) if t2 else None
            if self.cuda:
                dpool = torch.empty(min(H, 1 << 20), rb, dtype=torch.uint8, device=self.dev)
                didx = log.host % dpool.shape[0]
                t3 = self._time(lambda: torch.index_select(dpool, 0, didx, out=staging))
                u[f"device_gather_{rb}B_GBps"] = round(mb / 1e3 / t3, 2)
                del dpool
        if self.cuda:
            nb = min(1 << 30, self.host_flat.numel())
            dst = torch.empty(nb, dtype=torch.uint8, device=self.dev)
            t = self._time(lambda: dst.copy_(self.host_flat[:nb], non_blocking=True))
            u["bulk_pinned_h2d_GBps"] = round(nb / 1e9 / t, 2)
            del dst
        else:
            u["note"] = "CPU: interpreter / CPU-memory figures, not GPU bandwidth"

    def _time(self, fn, iters=None):
        iters = iters or (10 if self.cuda else 1)
        fn()
        self.sync()
        if self.cuda:
            torch = self.torch
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) / 1e3 / iters
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters

    # ------------------------------------------------------------------ graphs
    def _graph_sizes(self, T):
        TK = T * self.Kk
        # A step's misses always fit; on CUDA above the small-pool threshold too (the policy
        # is forced to the round-label PB-LRU anyway).
        D = max(4097 if self.cuda else 256, 3 * TK)
        N = 4 * D
        return N, D, N  # host never full: no staged promotions

    def graphs(self):
        g = self.rep.data["graphs"]
        g["mode"] = "cuda_graph" if self.cuda else "eager (CPU: graph capture skipped, no CUDA)"
        if not self.cuda:
            self.rep.note("graph capture skipped on cpu: the same pipeline runs eagerly with the "
                          "tables changed between steps")
        print(f"== graphs ({g['mode']}) ==", flush=True)
        g["runs"] = []
        for T in self.graph_Ts:
            for rb in (FP8_ROW, BF16_ROW):
                g["runs"].append(self._graph_run(T, rb))
        g["ok"] = all(r["ok"] for r in g["runs"])
        for r in g["runs"]:
            self.rep.parity(f"graph T={r['T']} row={r['row_bytes']}: every replay bit-equal to "
                            f"the eager reference", r["ok"],
                            replays=r["replays"], misses=r["misses"])

    def _graph_run(self, T, rb):
        torch, K, tk = self.torch, self.K, self.tk
        from ulacache_vllm.core import DEVICE, HOST, STAGING, TieredMapping
        from ulacache_vllm.core.pblru import PBLRU

        dev, Kk = self.dev, self.Kk
        N, D, H = self._graph_sizes(T)
        S = T * Kk
        trash = S + D
        Hq = 8
        gen = self.gen(1000 + T + rb)
        m = TieredMapping(N, D, H, device=dev, lru=lambda n, d, r: PBLRU(n, d, r), ring_size=4)
        buf = torch.zeros(S + D + 1, rb, dtype=torch.uint8, device=dev)
        host = self.host_rows(rb, H)
        truth = torch.zeros(N, rb, dtype=torch.uint8, device=dev)
        pools = {DEVICE: buf[S:S + D], HOST: host,
                 STAGING: torch.empty(0, rb, dtype=torch.uint8, device=dev)}

        def copy_fn(st, src, dt, dst):  # stream-ordered GPU ops (host rows through the view)
            pools[dt].index_copy_(0, dst, pools[st].index_select(0, src))

        live = torch.zeros(N, dtype=torch.bool, device=dev)
        nxt = 0
        chunk = max(1, D // 4)
        while nxt < int(0.6 * N):  # prefill: 60 % of N live, D = N / 4 of them on the device
            a = torch.arange(nxt, min(nxt + chunk, int(0.6 * N)), device=dev)
            truth[a] = valid_rows(torch, a.numel(), rb, gen, dev)
            slots, plan = m.assign(a)
            plan.apply(copy_fn)
            buf[S + slots] = truth[a]
            live[a] = True
            m.advance_round()
            nxt += a.numel()
        state = self.kref.ResolveState(N, S, dev, for_triton=True)
        s = {"logical": torch.full((T, Kk), -1, dtype=torch.int64, device=dev),
             "new": torch.full((T,), -1, dtype=torch.int64, device=dev),
             "newrows": torch.zeros(T, rb, dtype=torch.uint8, device=dev),
             "ntok": torch.full((1,), T, dtype=torch.int32, device=dev),
             "ident": torch.zeros(1, dtype=torch.int32, device=dev),
             "round": torch.zeros(1, dtype=torch.int64, device=dev),
             "q": torch.zeros(T, Hq, 576, device=dev),
             "werr": torch.zeros(1, dtype=torch.int64, device=dev),
             "wrows": torch.zeros(T, dtype=torch.int64, device=dev),
             "rows": torch.zeros(T, Kk, dtype=torch.int32, device=dev),
             "bytes": torch.zeros(T, Kk, rb, dtype=torch.uint8, device=dev),
             "out": torch.zeros(T, Hq, 512, device=dev)}
        labels = m.policy.labels

        def pipeline():
            tk.write_translate(s["new"], m.visible, s["ident"], dev_base=S, trash_row=trash,
                               errors=s["werr"], out=s["wrows"])
            buf.index_copy_(0, s["wrows"], s["newrows"])
            tk.resolve(s["logical"], m.visible, labels, s["round"], s["ntok"], s["ident"],
                       state, dev_base=S, out=s["rows"])
            tk.stage(host, buf[:S], state.log)
            r = s["rows"].long()
            got = buf.index_select(0, r.clamp(min=0).view(-1)).view(T, Kk, rb)
            s["bytes"].copy_(torch.where((r >= 0)[..., None], got, 0))
            s["out"].copy_(attend(torch, s["q"], s["bytes"], r >= 0, rb))

        run = pipeline
        if self.cuda:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up (compiles the kernels): writes go to trash
                for _ in range(2):
                    pipeline()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                pipeline()
            run = graph.replay
        self.sync()
        res = {"T": T, "row_bytes": rb, "K": Kk, "replays": 0, "bytes_equal": True,
               "out_bit_equal": True, "misses": 0, "write_errors": 0, "overflow": 0,
               "identity_replay": None}
        prev_miss = False
        for step in range(self.graph_steps + 1):
            identity = step == self.graph_steps
            # ---- outside the graph (the engine's start_load_kv): settle, frees, assign
            if prev_miss:
                addr, _, ovf, unm = state.log.take()
                res["overflow"] += ovf
                m.advance_round()
                _, plan = m.ensure_resident(addr)
                plan.apply(copy_fn)
            else:
                m.advance_round()
            if identity:
                s["new"].fill_(-1)
                s["ident"].fill_(1)
                sel = torch.randint(0, D, (T, Kk), generator=gen, device=dev)
            else:
                livei = live.nonzero().squeeze(1)
                fr = livei[torch.randperm(livei.numel(), generator=gen, device=dev)[:T]]
                m.free(fr)
                live[fr] = False
                nn = max(1, T - T // 8)
                new = torch.arange(nxt, nxt + nn, device=dev) % N
                new = new[~live[new]]
                nxt += nn
                rows_new = valid_rows(torch, new.numel(), rb, gen, dev)
                slots, plan = m.assign(new)
                plan.apply(copy_fn)
                truth[new] = rows_new
                live[new] = True
                s["new"].fill_(-1)
                s["new"][:new.numel()] = new
                s["newrows"].zero_()
                s["newrows"][:new.numel()] = rows_new
                livei = live.nonzero().squeeze(1)
                cand = livei[torch.randint(0, livei.numel(), (max(1, T * Kk // 2),),
                                           generator=gen, device=dev)]
                sel = cand[torch.randint(0, cand.numel(), (T, Kk), generator=gen, device=dev)]
                sel[:, :1] = new[:1] if new.numel() else sel[:, :1]  # read this step's write
            sel = torch.where(torch.rand(T, Kk, generator=gen, device=dev) < 0.1, -1, sel)
            ntok = int(torch.randint(max(1, T - T // 4), T + 1, (1,), generator=gen, device=dev))
            s["logical"].copy_(sel)
            s["ntok"].fill_(ntok)
            s["round"].fill_(getattr(m.policy, "round", 0))
            s["q"].copy_(torch.randn(T, Hq, 576, generator=gen, device=dev))
            before = buf.clone() if identity else None
            # ---- the graph
            run()
            self.sync()
            # ---- eager reference over the unpaged rows
            valid = (torch.arange(T, device=dev) < ntok)[:, None] & (sel >= 0)
            src = before[S + sel.clamp(min=0)] if identity else truth[sel.clamp(min=0)]
            want = torch.where(valid[..., None], src, 0)
            ref_out = attend(torch, s["q"], want, valid, rb)
            b_ok = torch.equal(s["bytes"], want) and torch.equal(s["rows"] >= 0, valid)
            o_ok = torch.equal(s["out"].view(torch.int32), ref_out.view(torch.int32))
            res["bytes_equal"] &= b_ok
            res["out_bit_equal"] &= o_ok
            if not o_ok:
                res["out_max_abs_diff"] = float((s["out"] - ref_out).abs().max())
            misses = int(state.log.counts[0])
            res["misses"] += misses
            prev_miss = misses > 0
            res["replays"] += 1
            if identity:
                res["identity_replay"] = b_ok and o_ok and misses == 0
        res["write_errors"] = int(s["werr"])
        st = m.stats
        res.update(promotions=st.promotions, demotions=st.demotions, freed=st.freed)
        res["ok"] = bool(res["bytes_equal"] and res["out_bit_equal"] and res["write_errors"] == 0
                         and res["overflow"] == 0 and res["misses"] > 0 and st.promotions > 0
                         and st.demotions > 0 and res["identity_replay"])
        print(f"  T={T} row={rb}: {res}", flush=True)
        return res

    # ------------------------------------------------------------------ timings
    def timings(self):
        torch = self.torch
        tm = self.rep.data["timings"]
        print("== timings ==", flush=True)
        T = 64 if self.cuda else 4
        Kk = self.Kk
        rb = FP8_ROW
        w = self.world(rb, 555)
        table = w["table"]
        dev_addr = ((table >= 0) & (table >> 32 == 0)).nonzero().squeeze(1)
        host_addr = (table >> 32 == 1).nonzero().squeeze(1)
        S = T * Kk
        label = "" if self.cuda else " (CPU reference path)"
        mod = self.tk if self.cuda else self.kref
        for frac in (0.0, 0.01, 0.1, 1.0):
            nm = int(round(frac * S))
            a = torch.cat([host_addr[torch.randperm(host_addr.numel(), device=self.dev)[:nm]],
                           dev_addr[torch.randperm(dev_addr.numel(), device=self.dev)[:S - nm]]])
            logical = a[torch.randperm(a.numel(), device=self.dev)].view(T, Kk)
            st = self.kref.ResolveState(self.N, S, self.dev, for_triton=mod is self.tk)
            staging = torch.empty(S, rb, dtype=torch.uint8, device=self.dev)
            rnd = torch.tensor([1], device=self.dev)
            labels = w["labels"]

            def step():
                mod.resolve(logical, table, labels, rnd, None, None, st, dev_base=S)
                mod.stage(w["host"], staging, st.log)

            t = self._time(step)
            key = f"resolve+stage T={T} K={Kk} {rb}B {int(frac * 100)}% miss ms{label}"
            tm[key] = round(t * 1e3, 3)
        self._settle_timing(tm, label)

    def _settle_timing(self, tm, label):
        torch = self.torch
        from ulacache_vllm.core import TieredMapping
        from ulacache_vllm.core.pblru import PBLRU

        N, D, H = self.N, self.D, self.H
        dev = self.dev
        m = TieredMapping(N, D, H, device=dev, lru=lambda n, d, r: PBLRU(n, d, r), ring_size=8)
        t = time.perf_counter()
        chunk = max(1, D // 4)
        fill = int(0.9 * N)  # host room left: promotions need no staging
        for lo in range(0, fill, chunk):
            _, plan = m.assign(torch.arange(lo, min(fill, lo + chunk), device=dev))
            plan.apply(lambda *a: None)
            m.advance_round()
        self.sync()
        tm[f"prefill {fill} addrs (assign, {D} device slots) s"] = round(time.perf_counter() - t, 2)
        g = self.gen(4242)
        for n in (1000, 10000):
            n = min(n, D // 2)
            ts = []
            for _ in range(5 if self.cuda else 3):
                cand = torch.randint(0, N, (4 * n,), generator=g, device=dev).unique()
                cand = cand[m.locate(cand)[1] >= 0][:n]
                self.sync()
                t = time.perf_counter()
                m.advance_round()
                _, plan = m.ensure_resident(cand)
                plan.apply(lambda *a: None)
                self.sync()
                ts.append(time.perf_counter() - t)
            ts.sort()
            key = f"settle ensure_resident+commit {n} misses ms{label}"
            tm[key] = round(ts[len(ts) // 2] * 1e3, 3)


def _cuda_ok(rc) -> bool:
    v = getattr(rc, "value", rc)
    try:
        return int(v) == 0
    except (TypeError, ValueError):
        return str(rc).lower().endswith("success")


def valid_rows(torch, n, rb, gen, dev):
    """``n`` byte rows that decode to finite values: bf16 [576] (1152 B) or fp8_ds_mla
    (512 e4m3 + 4 fp32 scales + 64 bf16, 656 B)."""
    if rb == BF16_ROW:
        return torch.randn(n, 576, generator=gen, device=dev).to(torch.bfloat16).view(torch.uint8)
    if rb == FP8_ROW:
        nope = torch.randn(n, 512, generator=gen, device=dev).to(torch.float8_e4m3fn)
        nope = nope.view(torch.uint8)
        scales = (torch.rand(n, 4, generator=gen, device=dev) + 0.5).view(torch.uint8)
        rope = torch.randn(n, 64, generator=gen, device=dev).to(torch.bfloat16).view(torch.uint8)
        return torch.cat([nope, scales, rope], 1)
    raise ValueError(rb)


def kv_from_bytes(torch, kvb, rb):
    """Byte rows [..., rb] -> float32 [..., 576] (NoPE 512 then RoPE 64)."""
    if rb == BF16_ROW:
        return kvb.view(torch.bfloat16).float()
    nope = kvb[..., :512].view(torch.float8_e4m3fn).float()
    scales = kvb[..., 512:528].view(torch.float32)
    rope = kvb[..., 528:656].view(torch.bfloat16).float()
    nope = (nope.unflatten(-1, (4, 128)) * scales[..., None]).flatten(-2)
    return torch.cat([nope, rope], -1)


def attend(torch, q, kvb, mask, rb):
    """Reference sparse MLA over gathered rows: softmax(q k^T / sqrt(576)) v, v = the NoPE
    part; masked rows excluded (a token with none gets zeros)."""
    kv = kv_from_bytes(torch, kvb, rb)
    s = torch.matmul(q, kv.transpose(1, 2)) * (1.0 / math.sqrt(576))
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.matmul(p, kv[..., :512])


if __name__ == "__main__":
    sys.exit(main())
