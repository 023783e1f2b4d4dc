"""The KV budget per GPU: what the weights leave of the GPU's memory, and which TP ranks share
vLLM's HiSparse host pool."""
from __future__ import annotations

import dataclasses

from .model import ModelShape, PlannerError
from .presets import WEIGHT_BYTES
from .records import Cluster, Plan

GIB = 1 << 30


def weights_per_gpu(model: ModelShape, cluster: Cluster, experts_over: str) -> float:
    """Dense weights split over TP; routed experts over TP x DP (expert parallelism over the
    whole cluster, ``experts_over='gpus'``) or over TP only."""
    for dt in (model.weights_dtype, model.expert_weights_dtype):
        if dt not in WEIGHT_BYTES:
            raise PlannerError(f"unknown weights dtype {dt!r}; one of {', '.join(WEIGHT_BYTES)}")
    ep = cluster.tp * cluster.dp if experts_over == "gpus" else cluster.tp
    return (model.dense_params * WEIGHT_BYTES[model.weights_dtype] / cluster.tp
            + model.expert_params * WEIGHT_BYTES[model.expert_weights_dtype] / ep)


def kv_budget(model: ModelShape, cluster: Cluster, experts_over: str) -> tuple[int, float]:
    w = weights_per_gpu(model, cluster, experts_over)
    if cluster.kv_bytes_per_gpu is not None:
        return int(cluster.kv_bytes_per_gpu), w
    kv = int(cluster.gpu_gib * GIB * cluster.gpu_util - w - cluster.activation_reserve_gib * GIB)
    if kv <= 0:
        raise PlannerError(
            f"no KV memory left: {cluster.gpu_gib:g} GiB x {cluster.gpu_util:g} utilisation - "
            f"{w / GIB:.1f} GiB weights per GPU - {cluster.activation_reserve_gib:g} GiB "
            f"activation reserve = {kv / GIB:.1f} GiB. Use more GPUs or a larger --tp, a "
            f"smaller --weights-dtype, or lower --activation-reserve-gib.")
    return kv, w


def hisparse_shared_ranks(cluster: Cluster) -> int:
    """TP ranks sharing vLLM's HiSparse host pool: all of an engine's ranks when TP > 1 and
    they sit on one node (vLLM also needs no PP/CP and the mp executor); else none (1)."""
    return cluster.tp if 1 < cluster.tp <= cluster.gpus_per_node else 1


def dp_plan(p: Plan, experts_over: str) -> Plan | str:
    """The same GPUs as DP engines of TP 1 (vLLM's --data-parallel-size GPUs, experts split
    over them when ``experts_over='gpus'``): each GPU holds the dense weights whole, its own KV
    budget, scheduler and host pool. The plan's own cluster when it is already TP 1; an error
    text when the weights leave such an engine no KV memory."""
    cl = p.cluster
    if cl.tp == 1:
        return p
    dcl = dataclasses.replace(cl, tp=1, dp=cl.gpus, name=f"{cl.name} as DP {cl.gpus} x TP 1")
    try:
        budget, w = kv_budget(p.model, dcl, experts_over)
    except PlannerError as e:
        return str(e)
    return Plan(p.model, dcl, p.request_tokens, p.kv_dtype, p.block_size, w, budget,
                ula_host_pool_gib=p.ula_host_pool_gib)
