"""`python -m ulacache_vllm.planner MODEL [--cluster 8xH200 ...]`: how many requests of one
length fit a cluster under stock vLLM, HiSparse and ulacache (see `capacity.py`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .capacity import make_cluster, plan
from .model import PlannerError, load_model
from .presets import CLUSTER_PRESETS, MODEL_PRESETS, WEIGHT_BYTES
from .report import render, to_json

DEFAULT_CLUSTER = "8xH200"


def request_tokens(text: str) -> int:
    """'131072', '128K' or '128k' (K = 1024), '1M' (= 1024 K)."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count (e.g. 131072 or 128K)") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ulacache_vllm.planner",
        description="Concurrent requests of one length that fit a cluster: stock vLLM, "
                    "HiSparse (host copy per rank; vLLM 0.32's shared host pool), ulacache "
                    "(DP engines; TP shard). Computed with the engine's own sizing code "
                    "(ulacache_vllm.engine.dsa.sizing.plan_layout) and vLLM's. DeepSeek-V4: "
                    "stock against ulacache's planned V4 line (v4.py), checked against "
                    "vLLM's own functions.")
    p.add_argument("model", help=f"a preset ({', '.join(MODEL_PRESETS)}), a config.json, "
                                 f"or a model directory")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", action="append", choices=sorted(CLUSTER_PRESETS),
                   help=f"cluster preset; repeat to compare (default {DEFAULT_CLUSTER} when no "
                        f"--gpus is given); the flags below override its figures")
    c.add_argument("--gpus", type=int, help="GPUs in the cluster (= TP x DP)")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--gpu-gib", type=float, help="memory per GPU, GiB")
    c.add_argument("--host-gib-per-gpu", type=float,
                   help="host memory per GPU given to KV pools, GiB")
    c.add_argument("--tp", type=int, help="tensor-parallel size of one engine")
    c.add_argument("--dp", type=int, help="engines (default GPUs / TP)")
    c.add_argument("--gpu-util", type=float, help="gpu_memory_utilization (default 0.9)")
    c.add_argument("--activation-reserve-gib", type=float,
                   help="per-GPU memory for activations and CUDA graphs (default 10)")
    c.add_argument("--kv-bytes-per-gpu", type=int,
                   help="give the per-GPU KV budget directly (as vLLM's "
                        "--kv-cache-memory-bytes); weights and utilisation are then ignored")
    c.add_argument("--max-num-batched-tokens", type=int)
    c.add_argument("--max-num-seqs", type=int)
    c.add_argument("--no-chunked-prefill", action="store_true")
    m = p.add_argument_group("model")
    m.add_argument("--weights-dtype", choices=sorted(WEIGHT_BYTES),
                   help="all weights (routed experts too unless --expert-weights-dtype)")
    m.add_argument("--expert-weights-dtype", choices=sorted(WEIGHT_BYTES))
    m.add_argument("--kv-dtype", help="auto (model dtype), bf16, fp32, fp8 (DSA: fp8_ds_mla)")
    m.add_argument("--mamba-ssm-cache-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="GDN hybrids: the SSM state's dtype, as vLLM's flag (default auto: the "
                        "model dtype; vLLM's CPU build forces float32 on AVX512-BF16 hosts)")
    m.add_argument("--experts-over", choices=("gpus", "tp"), default="gpus",
                   help="routed experts split over all GPUs (expert parallelism, default) or "
                        "over the TP ranks only")
    m.add_argument("--params-b", type=float, help="total parameters, billions (overrides the "
                                                  "count from the config)")
    m.add_argument("--expert-params-b", type=float, help="of which routed experts, billions")
    m.add_argument("--block-size", type=int, help="KV block size (DSA default 64)")
    m.add_argument("--ula-host-pool-gib", type=float,
                   help="ulacache host pool per rank (default: the host memory per GPU, or "
                        "the largest smaller pool the engine starts with)")
    p.add_argument("--request-tokens", type=request_tokens, default=128 << 10,
                   help="tokens per request, prompt + output (default 128K = 131072)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-vllm-check", action="store_true",
                   help="DeepSeek-V4: skip comparing the planner's arithmetic with vLLM's own "
                        "grouping and the engine's plan_arena (no vLLM import; same figures)")
    return p


def plans_from_args(args: argparse.Namespace):
    model = load_model(args.model, args.params_b, args.expert_params_b)
    if args.weights_dtype:
        model.weights_dtype = model.expert_weights_dtype = args.weights_dtype
    if args.expert_weights_dtype:
        model.expert_weights_dtype = args.expert_weights_dtype
    if args.mamba_ssm_cache_dtype:
        model.mamba_ssm_cache_dtype = args.mamba_ssm_cache_dtype
    given = dict(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_gib=args.gpu_gib,
                 host_gib_per_gpu=args.host_gib_per_gpu, tp=args.tp, dp=args.dp,
                 gpu_util=args.gpu_util, activation_reserve_gib=args.activation_reserve_gib,
                 kv_bytes_per_gpu=args.kv_bytes_per_gpu,
                 max_num_batched_tokens=args.max_num_batched_tokens,
                 max_num_seqs=args.max_num_seqs,
                 chunked_prefill=False if args.no_chunked_prefill else None)
    presets = args.cluster or ([None] if args.gpus else [DEFAULT_CLUSTER])
    return [plan(model, make_cluster(c, **given), args.request_tokens, kv_dtype=args.kv_dtype,
                 experts_over=args.experts_over, block_size=args.block_size,
                 ula_host_pool_gib=args.ula_host_pool_gib, check_vllm=not args.no_vllm_check)
            for c in presets]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        plans = plans_from_args(args)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(plans), indent=1))
    else:
        print(render(plans), end="")
    return 0


if __name__ == "__main__":
    # Quiet vLLM's config logging for the command line only: main() is also called in-process
    # (tests), where changing the caller's environment would leak into every later subprocess.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.exit(main())
