"""The assumptions printed under every plan: what the figures of `capacity.plan` rest on."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .budget import GIB, hisparse_shared_ranks
from .model import attention_token_bytes, dsa_specs, gdn_state, state_bytes
from .presets import WEIGHT_BYTES

if TYPE_CHECKING:
    from .records import Plan


def head(p: Plan, experts_over: str) -> list[str]:
    """The lines every plan starts with: notes, cluster, weights, KV budget, request length."""
    m, cl, L = p.model, p.cluster, p.request_tokens
    ep = cl.tp * cl.dp if experts_over == "gpus" else cl.tp
    out = list(m.notes) + list(cl.notes)
    out.append(f"cluster: {cl.gpus} GPUs = DP {cl.dp} engines x TP {cl.tp}; "
               f"{cl.gpus_per_node} GPUs per node")
    wb, eb = WEIGHT_BYTES[m.weights_dtype], WEIGHT_BYTES[m.expert_weights_dtype]
    out.append(
        f"weights per GPU {p.weights_per_gpu / GIB:.1f} GiB = dense {m.dense_params / 1e9:.1f}B "
        f"params x {wb:g} B ({m.weights_dtype}) / TP {cl.tp} + routed experts "
        f"{m.expert_params / 1e9:.1f}B x {eb:g} B ({m.expert_weights_dtype}) / EP {ep} "
        + ("(expert parallelism over all TP x DP GPUs)" if experts_over == "gpus"
           else "(experts over the TP ranks only)")
        + "; replicated small projections, norms, biases, FP8 block scales and the MTP "
          "layer are left out")
    if cl.kv_bytes_per_gpu is not None:
        out.append(f"KV budget per GPU given directly: {p.kv_budget} bytes "
                   f"({p.kv_budget / GIB:.2f} GiB)")
    else:
        out.append(
            f"KV budget per GPU {p.kv_budget / GIB:.1f} GiB = {cl.gpu_gib:g} GiB x "
            f"{cl.gpu_util:g} (gpu_memory_utilization) - weights - "
            f"{cl.activation_reserve_gib:g} GiB activation/CUDA-graph reserve "
            f"(--activation-reserve-gib)")
    out.append(f"every request is {L} tokens (prompt + output) and is the engine's "
               f"max_model_len; counts are concurrent requests whose KV fits, not throughput")
    return out


TAIL = ("not modelled: prefix-cache reuse, speculative decoding, fragmentation from mixed "
        "request lengths, PCIe / NVLink bandwidth (capacity only)")


def assumptions(p: Plan, experts_over: str) -> list[str]:
    m, cl = p.model, p.cluster
    out = head(p, experts_over)
    if m.kind == "dsa":
        mla = sum(s.page_size_bytes for n, s in dsa_specs(m, p.kv_dtype, 1).items()
                  if not n.endswith("k_cache"))
        idx = sum(s.page_size_bytes for n, s in dsa_specs(m, p.kv_dtype, 1).items()
                  if n.endswith("k_cache"))
        out.append(f"KV per token: MLA {mla} B ({p.kv_dtype} rows, "
                   f"{m.config['num_hidden_layers']} layers) + indexer keys {idx} B; "
                   f"block size {p.block_size}")
        out.append("stock: vLLM's get_kv_cache_groups / get_kv_cache_config_from_groups / "
                   "get_max_concurrency_for_kv_cache_config; MLA specs have max_tp_shards=1, "
                   "so every TP rank holds every token's MLA row and indexer key")
        out.append("best vLLM: the stock or HiSparse row (TP or DP engines) that holds the "
                   "most requests cluster-wide, the configuration a user would otherwise "
                   "pick; every multiple is requests that fit, not throughput")
        out.append(
            f"HiSparse: vLLM 0.32's HiSparse layout and steady-state concurrency "
            f"(device: indexer keys of every token + a hot buffer of 2 x index_topk rows "
            f"and 2 resident tail pages per layer group; host: every MLA row, a copy, not "
            f"exclusive). Host copy per rank: each rank pins {cl.host_gib_per_gpu:g} GiB. "
            f"Shared: one pool of {cl.host_gib_per_gpu:g} GiB x {hisparse_shared_ranks(cl)} "
            f"ranks per engine (vLLM shares it when TP > 1 within a node, no PP/CP)")
        pool = (f"{p.ula_host_pool_gib:g} (given)" if p.ula_host_pool_gib is not None else
                f"{cl.host_gib_per_gpu:g} (or the largest smaller pool the engine starts with)")
        out.append(
            f"ulacache: engine.sizing.plan_layout with UlaSettings(host_pool_gib="
            f"{pool}, tp_mode=replicate|shard): device = indexer keys of "
            f"every logical token (of its share in shard mode) + device MLA rows + 1 B/token "
            f"placeholders per layer; host pool per rank; exclusive residency (logical = "
            f"device + host rows); shard mode: token t on rank t mod {cl.tp}, minus a "
            f"remote-row buffer (default: max_num_seqs x index_topk rows, at most 1/32 of "
            f"the rows the KV budget would hold at one row per token: "
            f"engine.dsa.sizing.plan_layout's cap)")
        d = p.dp_engines
        if isinstance(d, str):
            out.append(f"DP engines (TP 1 x DP {cl.gpus}): do not fit: {d}")
        elif d is not None and d is not p:
            out.append(
                f"DP engines: the same {cl.gpus} GPUs as {cl.gpus} engines of TP 1 (vLLM "
                f"--data-parallel-size {cl.gpus}), each with its own scheduler, KV budget and "
                f"host pool, nothing replicated across ranks; dense weights whole on every GPU "
                f"({d.weights_per_gpu / GIB:.1f} GiB per GPU with the routed experts "
                + ("over all GPUs" if experts_over == "gpus" else "unsplit")
                + f"), KV budget {d.kv_budget / GIB:.1f} GiB per GPU; requests per cluster = "
                  f"per engine x {cl.gpus}. HiSparse shares no host pool at TP 1; ulacache's "
                  f"DP row is plan_layout at TP 1")
        out.append(f"scheduler: max_num_batched_tokens {cl.max_num_batched_tokens} "
                   f"({'vLLM default' if cl.batch_tokens_defaulted else 'given'}), "
                   f"max_num_seqs {cl.max_num_seqs}, chunked prefill "
                   f"{'on' if cl.chunked_prefill else 'off'} (ulacache's startup checks and "
                   f"remote buffer read them)")
    else:
        tok = attention_token_bytes(m, p.kv_dtype, cl.tp)
        heads = m.config["num_key_value_heads"]
        out.append(f"attention KV per token per layer per rank: {tok} B ({p.kv_dtype}; "
                   f"{heads} KV heads over TP {cl.tp}: {max(1, heads // cl.tp)} per rank"
                   + (f", replicated {cl.tp // heads}x" if cl.tp > heads else "") + ")")
        from ulacache_vllm.engine.arena import sizing as arena_sizing
        from ulacache_vllm.engine.arena.sizing import ARENA_BLOCK_SIZE

        arena = (f"ulacache arena: engine.arena_sizing.plan_arena (the engine's startup "
                 f"sizing) on the specs the engine builds under --kv-backend ulacache: "
                 f"layers grouped by spec, one page per group holding all its layers, pages "
                 f"rounded up to the arena's alignment (a power of two dividing the page "
                 f"sizes, doubled until the arena has at most {arena_sizing.MAX_GRANULES} "
                 f"granules), a null page reserved; attention in "
                 f"{ARENA_BLOCK_SIZE}-token pages; {{}}; prefix caching off (modelled so; the "
                 f"engine keeps it on where stock has it, not modelled here). The engine runs "
                 f"the arena on vLLM's CPU build (TP included: every rank "
                 f"runs the same plan on its heads' share of each page); on GPUs this is its "
                 f"sizing per rank, not a configuration it starts yet")
        if m.kind == "gdn":
            shapes, dtypes = gdn_state(m, cl.tp)
            st = state_bytes(shapes, dtypes)
            out.append(f"GDN state per layer per rank: {st} B (conv {shapes[0]} "
                       f"{str(dtypes[0]).removeprefix('torch.')}, SSM {shapes[1]} "
                       f"{str(dtypes[1]).removeprefix('torch.')}: --mamba-ssm-cache-dtype "
                       f"{m.mamba_ssm_cache_dtype}, vLLM's default 'auto' is the model dtype; "
                       f"its CPU build forces float32 on AVX512-BF16 hosts)")
            out.append(
                f"stock HMA: attention block {p.block_size} tokens so that its page "
                f"({p.block_size * tok} B) holds one GDN state ({st} B, padded up to the "
                f"page); mamba_cache_mode 'align' (prefix caching on, vLLM's default for "
                f"hybrids): 2 state pages per GDN layer group per request; vLLM's own "
                f"grouping and concurrency functions")
            out.append(arena.format(f"one {st} B state page per GDN layer per request "
                                    f"(exactly the state's bytes, no padding, no "
                                    f"prefix-cache checkpoints)"))
        else:
            out.append(
                f"stock HMA: {p.block_size}-token blocks (FlashAttention); a sliding layer "
                f"reserves window - 1 + max_num_batched_tokens ({cl.max_num_batched_tokens}) "
                f"tokens per request (vLLM's admission bound for tokens in flight); vLLM's "
                f"own grouping and concurrency functions")
            out.append(arena.format(
                f"a sliding layer ({m.config['sliding_window']}-token window) reserves "
                f"vLLM's admission cap, SlidingWindowSpec.max_admission_blocks_per_request "
                f"(window - 1 + {cl.max_num_batched_tokens} tokens in flight, + 1 page), "
                f"in its own {ARENA_BLOCK_SIZE}-token pages"))
        out.append("HiSparse and the ulacache DP / TP shard rows do not apply (they serve DSA "
                   "sparse-MLA models)")
    out.append(TAIL)
    return out
