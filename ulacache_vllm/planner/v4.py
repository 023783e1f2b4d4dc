"""DeepSeek-V4 plans: stock vLLM against ulacache's planned V4 line (issue 44) on the cluster's
TP engines and on DP engines of TP 1 at equal device memory, the physical bound, and the bytes
per request of each cache kind.

Invariants: every figure is ``v4_sizing``'s arithmetic on the caches vLLM 0.32 declares for V4
(``v4_layout``); the ulacache figures are the v4 line's design (CSA rows on the host tier,
every other cache at its natural page size) computed here, not the engine's sizing; with
``check=True`` (the command line) ``v4_check`` first compares
the stock groups, block stride and startup figure with vLLM's own functions and the arena
kinds with the engine's ``plan_arena``, and refuses to print figures that disagree. vLLM's
HiSparse refuses V4 and ulacache's TP shard mode is not part of the V4 line: those rows carry
the reason instead of a count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .budget import GIB, dp_plan, kv_budget
from .errors import PlannerError
from .model import ModelShape, kv_dtype_of
from .records import Cluster, Plan, Row
from .v4_layout import MAIN_BLOCK, Cache, v4_caches
from .v4_sizing import (
    Sched,
    StockFit,
    UlaFit,
    UlaLine,
    exact_device_bytes,
    stock_fit,
    ula_line,
)

SWEEP_GIB = (0, 64, 128, 256, 512)  # host pool per GPU for the sweep line
HISPARSE_REFUSES = ("vLLM 0.32's HiSparse refuses DeepSeek-V4 ('HiSparse does not support "
                    "DeepSeek V4.', v1/hisparse/layout.py)")


@dataclass
class Deployment:
    """One way to deploy the GPUs (the cluster's TP engines, or DP engines of TP 1)."""
    key: str  # "tp" | "dp"
    plan: Plan  # its cluster and per-rank KV budget
    stock: StockFit
    line: UlaLine
    ula: UlaFit  # steady count (the headline)
    ula_reserve: UlaFit  # every request at its startup reservation
    exact: int  # device bytes per request with the CSA rows on the host (the bound's)
    sweep: list[tuple[float, int]] = field(default_factory=list)  # (host GiB, requests)

    @property
    def bound(self) -> int:
        return self.plan.kv_budget // self.exact


@dataclass
class V4Detail:
    caches: list[Cache]
    sched: Sched
    host_gib: float  # host pool bound per GPU (given pool or the host memory per GPU)
    pool_given: bool
    deployments: dict[str, Deployment] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)  # what v4_check compared, equal


def deploy(key: str, plan: Plan, caches: list[Cache], sched: Sched, host_gib: float,
           pool_given: bool) -> Deployment:
    budget, L = plan.kv_budget, plan.request_tokens
    st = stock_fit(caches, budget, L, sched)
    line = ula_line(caches, budget, L, sched)
    host = int(host_gib * GIB)
    d = Deployment(key, plan, st, line, line.fit(budget, host, pool_given, "steady"),
                   line.fit(budget, host, pool_given, "reserve"),
                   exact_device_bytes(caches, L))
    d.sweep = [(g, line.fit(budget, int(g * GIB), False, "steady").requests)
               for g in sorted({*SWEEP_GIB, host_gib})]
    return d


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def stock_row(d: Deployment, key: str, label: str) -> Row:
    cl, st, L = d.plan.cluster, d.stock, d.plan.request_tokens
    n = st.steady
    return Row(key, label, tokens=n * L, requests=n, cluster_requests=n * cl.dp,
               device_bytes=d.plan.kv_budget, tp=cl.tp, dp=cl.dp,
               note=(f"{st.resident_blocks} blocks of {st.stride:,} B a request "
                     f"({_mb(st.resident_blocks * st.stride)}); startup figure "
                     f"{st.reserve:.1f}"))


def ula_row(d: Deployment, key: str, label: str) -> Row:
    cl, f, L, line = d.plan.cluster, d.ula, d.plan.request_tokens, d.line
    n = f.requests
    note = (f"device {_mb(line.device_request_bytes)} + CSA rows "
            f"{_mb(line.csa_request_bytes)} a request; CSA pools: {f.device_blocks:,} device "
            f"+ {f.host_blocks:,} host blocks of {MAIN_BLOCK} tokens; "
            f"{n / max(1, d.bound):.2f} of the physical bound ({d.bound:,}); startup figure "
            f"{d.ula_reserve.requests}")
    seqs = cl.max_num_seqs
    if n > seqs:
        note += (f"; more than max_num_seqs {seqs}: pass --max-num-seqs {n} (left at {seqs}: "
                 f"{seqs * cl.dp:,} cluster-wide)")
    return Row(key, label, tokens=n * L, requests=n, cluster_requests=n * cl.dp,
               device_bytes=d.plan.kv_budget, host_bytes=f.host_bytes, note=note,
               layout=d.line, host_pool_gib=f.host_bytes / GIB, tp=cl.tp, dp=cl.dp)


def plan_v4(model: ModelShape, cluster: Cluster, request_tokens: int, *,
            kv_dtype: str | None = None, experts_over: str = "gpus",
            block_size: int | None = None, ula_host_pool_gib: float | None = None,
            check: bool = True, in_flight_batches: int = 2) -> Plan:
    """The V4 plan (rows keyed as the DSA plans' are); ``check`` compares with vLLM first."""
    if block_size not in (None, MAIN_BLOCK):
        raise PlannerError(f"--block-size {block_size}: DeepSeek-V4's sparse-MLA and indexer "
                           f"backends take {MAIN_BLOCK}-token blocks only; leave it out")
    kvd = kv_dtype_of(model, kv_dtype)
    budget, w = kv_budget(model, cluster, experts_over)
    p = Plan(model, cluster, request_tokens, kvd, MAIN_BLOCK, w, budget,
             ula_host_pool_gib=ula_host_pool_gib)
    caches = v4_caches(model.config)
    sched = Sched(cluster.max_num_batched_tokens, model.config["index_topk"],
                  in_flight_batches)
    given = ula_host_pool_gib is not None
    det = V4Detail(caches, sched, ula_host_pool_gib if given else cluster.host_gib_per_gpu,
                   given)
    p.extra = det
    tp = cluster.tp
    if tp > 1:
        d = deploy("tp", p, caches, sched, det.host_gib, given)
        det.deployments["tp"] = d
        p.rows.append(stock_row(d, "stock",
                                f"stock vLLM, TP-{tp} engines (KV replicated per rank)"))
    else:
        why = "TP=1: the cluster's engines are the DP engines below"
        p.rows.append(Row("stock", "stock vLLM, TP engines", error=why))
    p.rows.append(Row("hisparse_per_rank", f"HiSparse, TP-{tp} engines, host copy per rank",
                      error=HISPARSE_REFUSES))
    p.rows.append(Row("hisparse_shared",
                      f"vLLM 0.32 HiSparse, TP-{tp} engines, one host pool per node",
                      error=HISPARSE_REFUSES))
    if tp > 1:
        p.rows.append(ula_row(det.deployments["tp"], "ulacache_replicate",
                              f"ulacache TP-{tp} engines, ranks replicate"))
    else:
        p.rows.append(Row("ulacache_replicate", "ulacache TP engines, ranks replicate",
                          error="TP=1: the cluster's engines are the DP engines below"))
    p.rows.append(Row("ulacache_shard", f"ulacache TP-{tp} engines, shard",
                      error="not in the V4 line (issue 44): V4's caches are replicated over "
                            "TP ranks (max_tp_shards=1); TP shard mode for V4 comes later"))
    dplan = dp_plan(p, experts_over)
    p.dp_engines = dplan
    labels = (("stock_dp", "stock vLLM, DP engines (TP 1)"),
              ("hisparse_dp", "HiSparse, DP engines (TP 1), host pool per engine"),
              ("ulacache_dp", "ulacache, DP engines (TP 1)"))
    if isinstance(dplan, str):
        p.rows.extend(Row(k, lab, error=f"DP engines of TP 1 do not fit: {dplan}")
                      for k, lab in labels)
    else:
        d = deploy("dp", dplan, caches, sched, det.host_gib, given)
        det.deployments["dp"] = d
        p.rows.append(stock_row(d, *labels[0]))
        p.rows.append(Row(labels[1][0], labels[1][1], error=HISPARSE_REFUSES))
        p.rows.append(ula_row(d, *labels[2]))
    if check:
        from .v4_check import check_against_vllm

        det.checked = check_against_vllm(p, det)
    from .v4_report import v4_assumptions

    p.assumptions = v4_assumptions(p, experts_over)
    return p
