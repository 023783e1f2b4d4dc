"""DSA-like selection traces: a synthetic generator, a file format, a loader and a replayer.

A trace is a list of ``TraceStep``s. Within a step, events apply in the order
free -> append -> select, then the scheduling round ends (``advance_round``).

File format (written by ``save_trace``, read by ``load_trace``; the engine records the same):

* ``.npz`` with five int64 arrays of equal length, one row per (event, address):
  ``step``, ``group`` (layer group), ``kind`` (0 free, 1 append, 2 select), ``req`` (request
  id), ``addr`` (logical address ``logical_block_id * block_size + offset``). Rows need not be
  sorted. Optional scalar ``num_logical``.
* ``.jsonl``: one JSON object per line, ``{"step": int, "group": int, "kind":
  "free"|"append"|"select", "req": [int, ...], "addr": [int, ...]}`` (``req`` may also be a
  single int applying to every address). An optional first line ``{"num_logical": int}``.

``free`` lists the addresses of a finished request, ``append`` the entries written this step
(prefill chunk or decode token), ``select`` the top-k logical addresses read (duplicates across
requests allowed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from .address_space import LogicalAddressSpace

FREE, APPEND, SELECT = 0, 1, 2
_KINDS = {"free": FREE, "append": APPEND, "select": SELECT}


@dataclass
class TraceStep:
    step: int
    group: int = 0
    free_addr: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    append_addr: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    select_addr: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    select_req: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


@dataclass
class Trace:
    steps: list[TraceStep]
    num_logical: int
    working_set: int = 0      # peak over steps of sum over live requests of |ever selected|
    peak_demand: int = 0      # peak unique entries one round needs on the device
    meta: dict = field(default_factory=dict)


def generate_dsa_trace(*, num_steps: int = 128, batch: int = 8, topk: int = 256,
                       overlap: tuple[float, float] = (0.6, 0.95),
                       prompt_len: tuple[int, int] = (1024, 4096),
                       decode_len: tuple[int, int] = (32, 96), prefill_chunk: int | None = None,
                       recency_mix: float = 0.7, recency_scale: float = 0.1,
                       block_size: int = 16, seed: int = 0) -> Trace:
    """Synthetic DSA decode trace for ``batch`` concurrent requests sharing one pool.

    Each request writes its prompt in chunks of ``prefill_chunk`` (default ``topk``) tokens,
    then decodes one token per step; each decode step selects ``topk`` positions of its
    history, keeping a fraction ``overlap`` (drawn per request) of the previous step's
    selection. New picks are recency-biased: with probability ``recency_mix`` the age is
    exponential with mean ``recency_scale * history``, else uniform. A finished request is
    freed and replaced at once.
    """
    g = torch.Generator().manual_seed(seed)
    rnd = np.random.default_rng(seed)
    chunk = prefill_chunk or topk
    max_len = prompt_len[1] + decode_len[1] + 1
    max_blocks = (batch + 1) * (-(-max_len // block_size)) + 1
    space = LogicalAddressSpace(max_blocks, block_size)
    live: dict[int, dict] = {}
    next_req, steps = 0, []
    ws_peak, demand_peak = 0, 0

    def admit():
        nonlocal next_req
        r = next_req
        next_req += 1
        live[r] = dict(prompt=int(rnd.integers(prompt_len[0], prompt_len[1] + 1)), written=0,
                       decode=int(rnd.integers(decode_len[0], decode_len[1] + 1)),
                       overlap=float(rnd.uniform(*overlap)), sel=None,
                       ever=torch.zeros(max_len, dtype=torch.bool))

    for _ in range(batch):
        admit()
    for s in range(num_steps):
        free_a, app_a, sel_a, sel_r = [], [], [], []
        for r in [r for r, st in live.items() if st["decode"] <= 0]:
            free_a.append(space.release(r))
            del live[r]
            admit()
        for r, st in live.items():
            if st["written"] < st["prompt"]:
                n = min(chunk, st["prompt"] - st["written"])
                app_a.append(space.extend(r, n))
                st["written"] += n
                continue
            L = st["written"]
            pos = _select(g, st["sel"], L, topk, st["overlap"], recency_mix, recency_scale)
            st["sel"] = pos
            st["ever"][pos] = True
            sel_a.append(space.addresses(r, pos))
            sel_r.append(torch.full((pos.numel(),), r, dtype=torch.int64))
            app_a.append(space.extend(r, 1))  # the token this step produces
            st["written"] += 1
            st["decode"] -= 1
        cat = (lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64))
        step = TraceStep(s, 0, cat(free_a), cat(app_a), cat(sel_a), cat(sel_r))
        steps.append(step)
        ws_peak = max(ws_peak, sum(int(st["ever"].sum()) for st in live.values()))
        demand_peak = max(demand_peak, step.select_addr.numel() + step.append_addr.numel())
    return Trace(steps, space.num_logical, ws_peak, demand_peak,
                 dict(batch=batch, topk=topk, overlap=overlap, seed=seed))


def _select(g, prev, L, k, overlap, mix, scale):
    k = min(k, L)
    keep = torch.empty(0, dtype=torch.int64)
    if prev is not None and prev.numel():
        keep = prev[torch.randperm(prev.numel(), generator=g)[: min(prev.numel(), round(overlap * k))]]
    taken = torch.zeros(L, dtype=torch.bool)
    taken[keep] = True
    taken[L - 1] = True  # the newest token is always attended
    need = k - int(taken.sum())
    picks = [keep, torch.tensor([L - 1])]
    for _ in range(4):
        if need <= 0:
            break
        n = 2 * need + 16
        age = (-torch.log1p(-torch.rand(n, generator=g)) * max(1.0, scale * L)).long()
        rec = (L - 1 - age).clamp_min(0)
        uni = torch.randint(0, L, (n,), generator=g)
        cand = torch.where(torch.rand(n, generator=g) < mix, rec, uni)
        cand = cand[~taken[cand]]
        cand = torch.unique(cand)
        cand = cand[torch.randperm(cand.numel(), generator=g)[:need]]
        taken[cand] = True
        picks.append(cand)
        need -= cand.numel()
    if need > 0:
        rest = (~taken).nonzero().squeeze(1)
        picks.append(rest[torch.randperm(rest.numel(), generator=g)[:need]])
    return torch.cat(picks)


# ---------------------------------------------------------------------------- file format
def save_trace(trace: Trace, path: str) -> None:
    cols = {k: [] for k in ("step", "group", "kind", "req", "addr")}
    for st in trace.steps:
        for kind, a, r in ((FREE, st.free_addr, None), (APPEND, st.append_addr, None),
                           (SELECT, st.select_addr, st.select_req)):
            if a.numel() == 0:
                continue
            n = a.numel()
            cols["step"].append(np.full(n, st.step)); cols["group"].append(np.full(n, st.group))
            cols["kind"].append(np.full(n, kind)); cols["addr"].append(a.numpy())
            cols["req"].append(r.numpy() if r is not None and r.numel() == n else np.full(n, -1))
    arrs = {k: (np.concatenate(v) if v else np.empty(0)).astype(np.int64) for k, v in cols.items()}
    if str(path).endswith(".jsonl"):
        with open(path, "w") as f:
            f.write(json.dumps({"num_logical": trace.num_logical}) + "\n")
            for st in trace.steps:
                for name, kind, a in (("free", FREE, st.free_addr), ("append", APPEND, st.append_addr),
                                      ("select", SELECT, st.select_addr)):
                    if a.numel():
                        req = st.select_req.tolist() if kind == SELECT else -1
                        f.write(json.dumps({"step": st.step, "group": st.group, "kind": name,
                                            "req": req, "addr": a.tolist()}) + "\n")
    else:
        np.savez_compressed(path, num_logical=np.int64(trace.num_logical), **arrs)


def load_trace(path: str) -> Trace:
    """Load a ``.npz`` or ``.jsonl`` trace (format in the module docstring)."""
    num_logical = None
    if str(path).endswith(".jsonl"):
        cols = {k: [] for k in ("step", "group", "kind", "req", "addr")}
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                o = json.loads(line)
                if "addr" not in o:
                    num_logical = o.get("num_logical", num_logical)
                    continue
                n = len(o["addr"])
                req = o.get("req", -1)
                cols["addr"].append(np.asarray(o["addr"], dtype=np.int64))
                cols["req"].append(np.asarray(req if isinstance(req, list) else [req] * n, dtype=np.int64))
                if o.get("kind") not in _KINDS or "step" not in o:
                    raise ValueError(f"{path}: trace line needs 'step' and 'kind' in "
                                     f"{sorted(_KINDS)}, got {line.strip()[:120]!r}")
                for k, v in (("step", o["step"]), ("group", o.get("group", 0)), ("kind", _KINDS[o["kind"]])):
                    cols[k].append(np.full(n, v, dtype=np.int64))
        a = {k: (np.concatenate(v) if v else np.empty(0, np.int64)) for k, v in cols.items()}
    else:
        z = np.load(path)
        missing = [k for k in ("step", "group", "kind", "req", "addr") if k not in z]
        if missing:
            raise ValueError(f"{path}: not a ulacache trace, missing arrays {missing} "
                             "(see ulacache_vllm.core.trace for the format)")
        a = {k: z[k].astype(np.int64) for k in ("step", "group", "kind", "req", "addr")}
        if "num_logical" in z:
            num_logical = int(z["num_logical"])
    order = np.lexsort((a["kind"], a["group"], a["step"]))
    a = {k: torch.from_numpy(v[order].copy()) for k, v in a.items()}
    steps = []
    if a["addr"].numel():
        key = a["step"] * (1 << 20) + a["group"]
        uniq, counts = torch.unique_consecutive(key, return_counts=True)
        start = 0
        for kval, c in zip(uniq.tolist(), counts.tolist()):
            sl = slice(start, start + c)
            kind, addr, req = a["kind"][sl], a["addr"][sl], a["req"][sl]
            steps.append(TraceStep(kval >> 20, kval & ((1 << 20) - 1), addr[kind == FREE],
                                   addr[kind == APPEND], addr[kind == SELECT], req[kind == SELECT]))
            start += c
    top = int(a["addr"].max()) + 1 if a["addr"].numel() else 0
    if num_logical is None:
        num_logical = top
    elif top > num_logical:
        raise ValueError(f"{path}: address {top - 1} is outside num_logical={num_logical}")
    demand = max((s.select_addr.numel() + s.append_addr.numel() for s in steps), default=0)
    return Trace(steps, num_logical, working_set=_working_set(steps), peak_demand=demand)


def _working_set(steps) -> int:
    """Peak count of live (appended, not freed) addresses that have been selected."""
    if not steps:
        return 0
    n = max(int(torch.cat([s.append_addr, s.select_addr, s.free_addr, torch.zeros(1, dtype=torch.int64)]).max())
            for s in steps) + 1
    live_sel = torch.zeros(n, dtype=torch.bool)
    peak = 0
    for s in steps:
        live_sel[s.free_addr] = False
        live_sel[s.append_addr] = False
        live_sel[s.select_addr] = True
        peak = max(peak, int(live_sel.sum()))
    return peak


def replay(trace: Trace, mappings: dict, copy_fn=None, on_step=None) -> None:
    """Drive ``mappings[group]`` (TieredMapping) through the trace; plans applied at once.

    ``copy_fn`` defaults to a no-op (bookkeeping only). ``on_step(step, t_seconds)`` gets the
    wall time of the step's mapping calls.
    """
    import time

    noop = copy_fn or (lambda *a: None)
    last_step = None
    for st in trace.steps:
        m = mappings[st.group]
        if last_step is not None and st.step != last_step:
            for mm in mappings.values():
                mm.advance_round()
        last_step = st.step
        t0 = time.perf_counter()
        if st.free_addr.numel():
            m.free(st.free_addr)
        if st.append_addr.numel():
            m.apply(m.assign(st.append_addr)[1], noop)
        if st.select_addr.numel():
            m.apply(m.ensure_resident(st.select_addr)[1], noop)
        if on_step is not None:
            on_step(st, time.perf_counter() - t0)
