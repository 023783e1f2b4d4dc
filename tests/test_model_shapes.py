"""`--kv-backend ulacache` on a DSA shape other than the default tiny model's: three sparse-MLA
layers (three layer groups), a wider top-k, more heads, MoE in every layer, random prompt
lengths. Greedy output must be token-identical to stock vLLM while rows really move between
the device and host pools, and every slot must be free at the end."""
from __future__ import annotations

import pytest

from _vllm_subprocess import IDLE_STEP, mla_path_kwargs, run_side_by_side, run_vllm_script

pytestmark = pytest.mark.engine  # every test here boots vLLM

SHAPE = dict(num_hidden_layers=3, index_topk=32, num_attention_heads=8, num_key_value_heads=8,
             first_k_dense_replace=0)
# ~2.2k device + ~1.9k host slots per layer: the device pool just holds one 2048-token step,
# well below the ~2.5k tokens the six prompts below hold at once. Both runs take the reference
# MLA path's schedule on every host (block 16, whole-prompt 2048-token steps, no prefix
# caching), which that sizing assumes: with AMX tiles vLLM would give block 128 and chunked
# prefill with a 4096-token default step.
ULA_KV_BYTES = 17_000_000
ULA_HOST_GIB = 0.012

SCRIPT = IDLE_STEP + r"""
import random
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
          max_num_seqs=6, seed=0, disable_log_stats=False, **ARGS["kw"])
rng = random.Random(7)
words = "the of cat dog runs blue seven apple river stone cloud music table window".split()
prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(100, 400))) for _ in range(6)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
res = {"out": [o.outputs[0].token_ids for o in outs]}
idle_step()
if ARGS["kw"]["kv_backend"] == "ulacache":
    res["usage"] = llm.collective_rpc("ulacache_usage")[0]
    res["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                      if m.name.startswith("vllm:ulacache_")}
emit(res)
"""


@pytest.fixture(scope="module")
def runs(tiny_model):
    """Stock and ulacache, side by side (``run_side_by_side``: disjoint CPUs, the same number
    of compute threads), each engine core in its script's process."""
    model = str(tiny_model("deepseek_v32", **SHAPE))

    def run(backend):
        kw = {"kv_backend": backend, **mla_path_kwargs("reference")}
        if backend == "ulacache":
            kw.update(kv_cache_memory_bytes=ULA_KV_BYTES, ula_host_pool_gib=ULA_HOST_GIB)
        else:
            kw.update(kv_cache_memory_bytes=256 << 20)
        return lambda bind: run_vllm_script(SCRIPT, args={"model": model, "kw": kw},
                                            timeout=900, env=bind)

    ref, ula = run_side_by_side(run("vllm"), run("ulacache"), in_process=True)
    return {"vllm": ref, "ulacache": ula}


def test_other_shape_token_exact_under_pressure(runs):
    ref, ula = runs["vllm"], runs["ulacache"]
    assert ula["out"] == ref["out"]
    m = ula["metrics"]
    assert m["vllm:ulacache_demotions"] > 0 and m["vllm:ulacache_promotions"] > 0, m
    u = ula["usage"]
    assert u["device_used"] == 0 and u["host_used"] == 0, u
    # One mapping table per sparse-MLA layer (three groups), each on the default PB-LRU's
    # small-pool path (pools this small take the timestamp scan).
    assert u["victim_paths"] == ["scan"] * 3, u
