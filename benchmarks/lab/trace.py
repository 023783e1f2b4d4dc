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
  single int applying to every address). Header lines ``{"num_logical": int}`` are optional
  (the engine writes one at startup; if several, the largest counts).

Steps are >= 0, groups in ``[0, 2**20)``, addresses >= 0; a file that breaks the format raises
``ValueError`` naming the problem. Traces are written to exactly the given path: JSON lines
for a ``.jsonl`` name (any case), npz otherwise.

``free`` lists the addresses of a finished request, ``append`` the entries written this step
(prefill chunk or decode token), ``select`` the top-k logical addresses read (duplicates across
requests allowed).
"""

from __future__ import annotations

import json
import numbers
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .address_space import LogicalAddressSpace
from ulacache_vllm.core.pools import CapacityError

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
    # peak unique entries one round appends: the device pool must hold them at once (a round's
    # selections beyond the pool are replayed in chunks, as the engine attends in chunks)
    peak_append: int = 0


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
    selection; the other picks avoid the previous selection, so consecutive top-k sets share
    exactly that fraction (up to rounding; more only while a history is too short to find
    other positions). New picks are recency-biased: with probability ``recency_mix`` the age is
    exponential with mean ``recency_scale * history``, else uniform. A finished request is
    freed and replaced at once.
    """
    _check_params(num_steps=num_steps, batch=batch, topk=topk, overlap=overlap,
                  prompt_len=prompt_len, decode_len=decode_len, prefill_chunk=prefill_chunk,
                  recency_mix=recency_mix, recency_scale=recency_scale, block_size=block_size,
                  seed=seed)
    seed = int(seed)
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
        # Finished: prompt written and decoded (a request drawn with 0 decode steps writes
        # its whole prompt first).
        for r in [r for r, st in live.items() if st["decode"] <= 0 and st["written"] >= st["prompt"]]:
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
                 dict(batch=int(batch), topk=int(topk), overlap=tuple(float(x) for x in overlap),
                      seed=int(seed)),
                 peak_append=max((s.append_addr.numel() for s in steps), default=0))


def _check_params(*, num_steps, batch, topk, overlap, prompt_len, decode_len, prefill_chunk,
                  recency_mix, recency_scale, block_size, seed) -> None:
    def need(ok, what):
        if not ok:
            raise ValueError(f"generate_dsa_trace: {what}")

    def is_int(x):
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    def is_range(r, kind):
        return (isinstance(r, (tuple, list)) and len(r) == 2
                and all(isinstance(x, kind) and not isinstance(x, bool) for x in r))

    ints = dict(num_steps=num_steps, batch=batch, topk=topk, block_size=block_size, seed=seed)
    bad = {k: v for k, v in ints.items() if not is_int(v)}
    need(not bad and (prefill_chunk is None or is_int(prefill_chunk)),
         f"num_steps, batch, topk, block_size, seed and prefill_chunk must be integers, got "
         f"{bad or {'prefill_chunk': prefill_chunk}}")
    need(0 <= seed < 2**63, f"seed must be in [0, 2**63), got {seed}")
    need(is_range(overlap, numbers.Real), f"overlap is a range (lo, hi) of numbers, got {overlap!r}")
    for name, r in (("prompt_len", prompt_len), ("decode_len", decode_len)):
        need(is_range(r, numbers.Integral), f"{name} is a range (lo, hi) of integers, got {r!r}")

    need(num_steps >= 0 and batch >= 1 and topk >= 1 and block_size >= 1,
         f"num_steps >= 0, batch, topk and block_size >= 1 (got {num_steps}, {batch}, {topk}, "
         f"{block_size})")
    need(len(overlap) == 2 and 0.0 <= overlap[0] <= overlap[1] <= 1.0,
         f"overlap is a range (lo, hi) with 0 <= lo <= hi <= 1, got {overlap}")
    need(len(prompt_len) == 2 and 1 <= prompt_len[0] <= prompt_len[1],
         f"prompt_len is a range (lo, hi) with 1 <= lo <= hi (a request needs a history to "
         f"select from), got {prompt_len}")
    need(len(decode_len) == 2 and 0 <= decode_len[0] <= decode_len[1],
         f"decode_len is a range (lo, hi) with 0 <= lo <= hi, got {decode_len}")
    need(prefill_chunk is None or prefill_chunk >= 1, f"prefill_chunk >= 1, got {prefill_chunk}")
    need(0.0 <= recency_mix <= 1.0 and recency_scale > 0,
         f"0 <= recency_mix <= 1 and recency_scale > 0, got {recency_mix}, {recency_scale}")


def _select(g, prev, L, k, overlap, mix, scale):
    """``k`` unique positions of a history of ``L`` tokens: the newest token, a random
    ``round(overlap * k)`` of ``prev`` (capped at ``k - 1``), and recency-biased new picks that
    avoid all of ``prev`` (so the overlap with ``prev`` is what was asked for, unless the history
    is too short to find enough other positions)."""
    k = min(k, L)
    taken = torch.zeros(L, dtype=torch.bool)
    taken[L - 1] = True  # the newest token is always attended
    keep = torch.empty(0, dtype=torch.int64)
    barred = taken
    if prev is not None and prev.numel():
        nkeep = min(prev.numel(), round(overlap * k), k - 1)
        keep = prev[torch.randperm(prev.numel(), generator=g)[:nkeep]]
        taken[keep] = True
        barred = taken.clone()
        barred[prev] = True
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
        cand = torch.unique(cand[~barred[cand]])
        cand = cand[torch.randperm(cand.numel(), generator=g)[:need]]
        barred[cand] = True
        taken[cand] = True
        picks.append(cand)
        need -= cand.numel()
    for pool in (barred, taken):  # fresh positions first; old ones only if history is short
        if need > 0:
            rest = (~pool).nonzero().squeeze(1)
            rest = rest[torch.randperm(rest.numel(), generator=g)[:need]]
            taken[rest] = True
            barred[rest] = True
            picks.append(rest)
            need -= rest.numel()
    return torch.cat(picks)


# ---------------------------------------------------------------------------- file format
_COLS = ("step", "group", "kind", "req", "addr")
_GROUP_BITS = 20  # steps and groups are sorted by one int64 key: step << 20 | group
_MAX_STEP = 1 << (62 - _GROUP_BITS)


def _is_jsonl(path) -> bool:
    return str(path).lower().endswith(".jsonl")


def save_trace(trace: Trace, path: str) -> None:
    """Write ``trace`` to ``path``: JSON lines if it ends in ``.jsonl``, else npz (at exactly
    ``path``: numpy would otherwise append ``.npz`` to other names)."""
    if _is_jsonl(path):
        with open(path, "w") as f:
            f.write(json.dumps({"num_logical": trace.num_logical}) + "\n")
            for st in trace.steps:
                for name, kind, a in (("free", FREE, st.free_addr), ("append", APPEND, st.append_addr),
                                      ("select", SELECT, st.select_addr)):
                    if a.numel():
                        # Requests per selected address when known, else -1 (as in npz).
                        known = kind == SELECT and st.select_req.numel() == a.numel()
                        req = st.select_req.tolist() if known else -1
                        f.write(json.dumps({"step": st.step, "group": st.group, "kind": name,
                                            "req": req, "addr": a.tolist()}) + "\n")
        return
    cols = {k: [] for k in _COLS}
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
    with open(path, "wb") as f:
        np.savez_compressed(f, num_logical=np.int64(trace.num_logical), **arrs)


class _Bad(ValueError):
    pass


def _ints(v, what: str) -> np.ndarray:
    """A 1-D int64 array from a list / array of integers; anything else is a ``_Bad``."""
    arr = np.asarray(v)
    if arr.ndim != 1:
        raise _Bad(f"{what} must be a 1-D list of integers, got {str(v)[:60]!r}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise _Bad(f"{what} must hold integers, got {arr.dtype} values")
    return arr.astype(np.int64)


def _int(v, what: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise _Bad(f"{what} must be an integer, got {v!r}")
    return int(v)


def _read_jsonl(path):
    cols = {k: [] for k in _COLS}
    num_logical = None
    with open(path) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"line {no}"
            try:
                o = json.loads(line)
            except json.JSONDecodeError as e:
                raise _Bad(f"{where} is not JSON ({e.msg})") from None
            if not isinstance(o, dict):
                raise _Bad(f"{where} must be a JSON object, got {line.strip()[:60]!r}")
            try:
                num_logical = _read_event(o, where, line, cols, num_logical)
            except _Bad:
                raise
            except (OverflowError, TypeError, ValueError) as e:  # e.g. 2**64, a list as kind
                raise _Bad(f"{where}: {type(e).__name__}: {e} in {line.strip()[:120]!r}") from None
    return {k: (np.concatenate(v) if v else np.empty(0, np.int64)) for k, v in cols.items()}, num_logical


def _read_event(o: dict, where: str, line: str, cols: dict, num_logical):
    """One JSON-lines record into ``cols``; returns the header's ``num_logical`` so far."""
    if "addr" not in o:
        if set(o) != {"num_logical"}:  # e.g. a misspelt key: not a header either
            raise _Bad(f"{where} is neither a header {{\"num_logical\": N}} nor an event "
                       f"with 'step', 'kind' and 'addr': {line.strip()[:120]!r}")
        n_l = _int(o["num_logical"], f"{where}: num_logical")
        return n_l if num_logical is None else max(num_logical, n_l)  # appended runs
    if o.get("kind") not in _KINDS or "step" not in o:
        raise _Bad(f"{where} needs 'step' and 'kind' in {sorted(_KINDS)}, got "
                   f"{line.strip()[:120]!r}")
    addr = _ints(o["addr"], f"{where}: addr")
    n = addr.size
    req = o.get("req", -1)
    req = _ints(req, f"{where}: req") if isinstance(req, list) else np.full(
        n, _int(req, f"{where}: req"), dtype=np.int64)
    if req.size != n:
        raise _Bad(f"{where}: 'req' has {req.size} entries for {n} addresses")
    cols["addr"].append(addr)
    cols["req"].append(req)
    for k, v in (("step", _int(o["step"], f"{where}: step")),
                 ("group", _int(o.get("group", 0), f"{where}: group")),
                 ("kind", _KINDS[o["kind"]])):
        cols[k].append(np.full(n, v, dtype=np.int64))
    return num_logical


def _read_npz(path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic[:1] != b"":  # npz files are zip archives
        raise _Bad("not an npz archive (JSON-lines traces need a .jsonl name)")
    try:
        z = np.load(path, allow_pickle=False)
        missing = [k for k in _COLS if k not in z.files]
        if missing:
            raise _Bad(f"not a ulacache trace, missing arrays {missing}")
        a = {k: _ints(z[k], f"array '{k}'") for k in _COLS}
        nl = z["num_logical"] if "num_logical" in z.files else None
    except _Bad:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        # Empty, truncated or corrupted archives; object arrays (no pickles are loaded).
        raise _Bad(f"unreadable npz ({type(e).__name__}: {e})") from None
    lens = {k: v.size for k, v in a.items()}
    if len(set(lens.values())) > 1:
        raise _Bad(f"arrays must have one row per event and address, got lengths {lens}")
    num_logical = None
    if nl is not None:
        if nl.ndim != 0:
            raise _Bad(f"num_logical must be a scalar, got shape {nl.shape}")
        num_logical = _int(nl[()], "num_logical")
    return a, num_logical


def load_trace(path: str) -> Trace:
    """Load a ``.jsonl`` (by name) or npz (otherwise) trace; format in the module docstring.

    Malformed files raise ``ValueError`` naming the file and the problem.
    """
    try:
        a, num_logical = _read_jsonl(path) if _is_jsonl(path) else _read_npz(path)
        for k, lo, hi in (("step", 0, _MAX_STEP), ("group", 0, 1 << _GROUP_BITS),
                          ("kind", FREE, SELECT + 1), ("addr", 0, None)):
            v = a[k]
            if v.size and (v.min() < lo or (hi is not None and v.max() >= hi)):
                bad = v[(v < lo) | (v >= hi)][0] if hi is not None else v[v < lo][0]
                raise _Bad(f"'{k}' value {bad} is outside [{lo}, {hi if hi is not None else 'inf'})")
        if num_logical is not None and num_logical < 0:
            raise _Bad(f"num_logical must be >= 0, got {num_logical}")
    except _Bad as e:
        raise ValueError(f"{path}: {e} (see ulacache_vllm.core.trace for the format)") from None
    order = np.lexsort((a["kind"], a["group"], a["step"]))
    a = {k: torch.from_numpy(v[order].copy()) for k, v in a.items()}
    steps = []
    if a["addr"].numel():
        key = (a["step"] << _GROUP_BITS) | a["group"]
        uniq, counts = torch.unique_consecutive(key, return_counts=True)
        start = 0
        for kval, c in zip(uniq.tolist(), counts.tolist()):
            sl = slice(start, start + c)
            kind, addr, req = a["kind"][sl], a["addr"][sl], a["req"][sl]
            steps.append(TraceStep(kval >> _GROUP_BITS, kval & ((1 << _GROUP_BITS) - 1),
                                   addr[kind == FREE], addr[kind == APPEND], addr[kind == SELECT],
                                   req[kind == SELECT]))
            start += c
    top = int(a["addr"].max()) + 1 if a["addr"].numel() else 0
    if num_logical is None:
        num_logical = top
    elif top > num_logical:
        raise ValueError(f"{path}: address {top - 1} is outside num_logical={num_logical}")
    # One round of one layer group needs its distinct selected and appended entries on the
    # device (requests may select the same address; the mapping dedups them).
    demand = max((torch.unique(torch.cat([s.select_addr, s.append_addr])).numel() for s in steps),
                 default=0)
    appended = max((torch.unique(s.append_addr).numel() for s in steps), default=0)
    return Trace(steps, num_logical, working_set=_working_set(steps), peak_demand=demand,
                 peak_append=appended)


def _working_set(steps) -> int:
    """Peak over steps of the live (appended, not freed) addresses that have been selected,
    per layer group (each group has its own pool), the largest group's."""
    if not steps:
        return 0
    # Dense ids for the addresses in use: a recorded trace may hold a few huge addresses.
    allv = torch.cat([torch.cat([s.append_addr, s.select_addr, s.free_addr]) for s in steps])
    uniq = torch.unique(allv)
    groups = sorted({s.group for s in steps})
    live = {g: torch.zeros(uniq.numel(), dtype=torch.bool) for g in groups}
    peak = 0
    for s in steps:
        ls = live[s.group]
        for addrs, val in ((s.free_addr, False), (s.append_addr, False), (s.select_addr, True)):
            if addrs.numel():
                ls[torch.searchsorted(uniq, addrs)] = val
        peak = max(peak, int(ls.sum()))
    return peak


def replay(trace: Trace, mappings: dict, copy_fn=None, on_step=None) -> int:
    """Drive ``mappings[group]`` (TieredMapping) through the trace; plans applied at once.

    ``copy_fn`` defaults to a no-op (bookkeeping only). ``on_step(step, t_seconds)`` gets the
    wall time of the step's mapping calls. A step whose selections exceed the device pool
    (``CapacityError``) is replayed as the engine runs it: request by request (a request
    larger than half the pool in slices of half the pool), a new round before each. Returns
    the number of such chunks.
    """
    import time

    noop = copy_fn or (lambda *a: None)
    last_step = None
    chunks = 0
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
            try:
                m.apply(m.ensure_resident(st.select_addr)[1], noop)
            except CapacityError:
                chunks += _select_in_chunks(m, st, noop)
        if on_step is not None:
            on_step(st, time.perf_counter() - t0)
    return chunks


def _select_in_chunks(m, st: TraceStep, noop) -> int:
    """The engine's fallback (worker_store.GroupTranslator.read_chunks) for one step."""
    addrs = st.select_addr
    if st.select_req.numel() == addrs.numel():
        order = torch.argsort(st.select_req, stable=True)
        addrs = addrs[order]
        _, counts = torch.unique_consecutive(st.select_req[order], return_counts=True)
        parts = torch.split(addrs, counts.tolist())
    else:  # no request ids: one request
        parts = (addrs,)
    half = max(1, m.dev.num_slots // 2)
    n = 0
    for part in parts:
        for i in range(0, part.numel(), half):
            m.advance_round()
            m.apply(m.ensure_resident(part[i:i + half])[1], noop)
            n += 1
    return n
