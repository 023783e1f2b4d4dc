"""The lab's emulated DeepSeek-V4 CPU ops (`benchmarks/lab/v4_ops/`) match eager references
of the kernels' math.

vLLM's V4 CPU path calls sixteen `torch.ops._C` kernels that exist only in its AVX512-BF16
build; on other x86 hosts the lab defines them from Python (`attention`, `indexer`,
`mhc_router`). Each module's `self_check()` compares its ops with independent eager
references (vLLM's parity-test formulas and per-token loop ports of the kernels): sparse MQA
attention over the fp8_ds_mla cache, the Q-norm/RoPE/KV-insert and its UE8M0 fp8 bytes, the
inverse RoPE, the weight pre-pack and bmm, the indexer's paged logits, top-512 selection (ties,
-1 slots), Q quant and the compressor's state save and norm/RoPE/store, the mHC pre/post/head
and the biased and hash top-k routers, on strided and padded views with invalid and
out-of-range slots. Those V4 runs (stock vLLM and ulacache alike go through the emulated ops)
check everything around the kernels; they mean something only because the emulated ops compute
what the kernels compute, which is what this file asserts. It also pins the op set: the sixteen
names, each with a schema that parses and is named as its key. Nothing is registered into
`torch.ops._C` here (other tests share the process).
"""
from __future__ import annotations

import pytest
import torch
from lab.v4_ops import attention, indexer, mhc_router

pytestmark = pytest.mark.timeout(120)

MODULES = {"attention": attention, "indexer": indexer, "mhc_router": mhc_router}

V4_OPS = {
    "flash_mla_with_kvcache_cpu",
    "fused_qnorm_rope_kv_insert_cpu",
    "inverse_gptj_rope_o_proj_cpu",
    "convert_weight_packed",
    "bmm_cpu",
    "fp8_paged_mqa_logits_cpu",
    "topk_transform_512_cpu",
    "fused_indexer_q_rope_quant_cpu",
    "save_partial_states_cpu",
    "compress_norm_rope_store_cpu",
    "compress_norm_rope_store_indexer_cpu",
    "hc_pre_fused_cpu",
    "hc_post_fused_cpu",
    "hc_head_fused_cpu",
    "biased_topk_cpu",
    "hash_topk_cpu",
}


@pytest.mark.parametrize("name", list(MODULES))
def test_emulated_ops_match_eager_references(name):
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    MODULES[name].self_check()
    # self_check is pure: the caller's RNG stream and thread setting are left as they were
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads


def test_ops_are_the_sixteen_v4_kernels_with_parsing_schemas():
    names = []
    for mod in MODULES.values():
        for key, (schema, impl) in mod.OPS.items():
            parsed = torch._C.parse_schema(schema)
            assert parsed.name == key, (key, str(parsed))
            assert callable(impl), key
            names.append(key)
    assert len(names) == len(set(names)), "an op defined in two modules"
    assert set(names) == V4_OPS


def test_schemas_are_the_ones_vllms_library_registers():
    """Each emulated schema is, argument for argument, the one vLLM's `_C.abi3.so` (the
    AVX512-BF16 build, shipped on every x86 host) registers: read from the library's bytes, not
    loaded (it would not load here without AVX512-BF16), so a vLLM whose kernels change shape
    fails here on any host."""
    import mmap
    from pathlib import Path

    import vllm

    lib = Path(vllm.__file__).parent / "_C.abi3.so"
    if not lib.exists():
        pytest.skip(f"{lib.name} is not in this vLLM build (not an x86 CPU wheel)")
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for mod in MODULES.values():
            for name, (schema, _) in mod.OPS.items():
                at = m.find(name.encode() + b"(Tensor")
                assert at >= 0, f"{name}: no schema in {lib.name}"
                real = m[at:m.find(b"\0", at)].decode()
                assert str(torch._C.parse_schema(real)) == str(torch._C.parse_schema(schema)), \
                    (real, schema)
