"""vLLM's CPU build runs MLA on one of two paths by host: with AMX tiles, chunked prefill and
prefix caching stay on (block 128); elsewhere the reference CPU_MLA kernel's limits apply
(block 16, both off, max_num_batched_tokens = max(max_model_len, 2048)). A DSA model follows
its host's path by default, and either path's choices can be pinned on any host (the engine
tests use that to run the same schedules everywhere). Configs are resolved in a subprocess:
vLLM's platform hook edits the process environment."""
from __future__ import annotations

import pytest

from _vllm_subprocess import (DENSE_MLA_LLM_KWARGS, host_has_amx, mla_path_kwargs,
                              run_vllm_script)

RESOLVE = r"""
import ulacache_vllm.patches.apply as patches
patches.apply_all()
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
from ulacache_vllm.engine import config as ula_config
out = {}
for label, model, kw in ARGS["cases"]:
    backend, settings = kw.pop("kv_backend", None), {}
    if backend:
        kw["additional_config"] = ula_config.merge_into_additional_config(None, backend, settings)
    ea = EngineArgs(model=model, max_model_len=1024, max_num_seqs=8, enforce_eager=True, **kw)
    c = ea.create_engine_config(UsageContext.LLM_CLASS)
    sc, cc = c.scheduler_config, c.cache_config
    out[label] = dict(chunked=sc.enable_chunked_prefill, batched=sc.max_num_batched_tokens,
                      prefix=cc.enable_prefix_caching, block=cc.block_size,
                      extra=sorted(c.additional_config or {}),
                      backend=str(c.attention_config.backend))
emit(out)
"""


@pytest.fixture(scope="module")
def resolved(tiny_model):
    dsa = str(tiny_model("deepseek_v32"))
    dense = str(tiny_model("deepseek_v3"))
    cases = [
        ("host", dsa, {}),
        ("amx", dsa, mla_path_kwargs("amx")),
        ("reference", dsa, mla_path_kwargs("reference")),
        ("amx_small_batch", dsa, {**mla_path_kwargs("amx"), "max_num_batched_tokens": 256}),
        ("dense", dense, {"attention_backend": DENSE_MLA_LLM_KWARGS["attention_backend"]}),
        ("ula_amx", dsa, {**mla_path_kwargs("amx"), "kv_backend": "ulacache"}),
        ("ula_reference", dsa, {**mla_path_kwargs("reference"), "kv_backend": "ulacache"}),
        ("ula_host", dsa, {"kv_backend": "ulacache"}),
        ("ula_reference_cached", dsa, {**mla_path_kwargs("reference"), "kv_backend": "ulacache",
                                       "enable_prefix_caching": True}),
    ]
    return run_vllm_script(RESOLVE, args={"cases": cases}, timeout=300, boots_engine=False)


def test_a_dsa_model_follows_its_hosts_path_by_default(resolved):
    want = "amx" if host_has_amx() else "reference"
    host, pinned = resolved["host"], resolved[want]
    for key in ("chunked", "prefix", "block", "batched"):
        assert host[key] == pinned[key], (want, host, pinned)


def test_the_amx_path_can_be_pinned_on_any_host(resolved):
    r = resolved["amx"]
    assert (r["chunked"], r["prefix"], r["block"], r["batched"]) == (True, True, 128, 4096), r
    small = resolved["amx_small_batch"]  # an explicit budget smaller than a prompt is kept
    assert small["chunked"] and small["batched"] == 256, small


def test_the_reference_path_can_be_pinned_on_any_host(resolved):
    r = resolved["reference"]
    assert (r["chunked"], r["prefix"], r["block"], r["batched"]) == (False, False, 16, 2048), r


def test_dense_mla_runs_the_reference_kernel_when_asked(resolved):
    r = resolved["dense"]
    assert "CPU_MLA" in r["backend"] and r["block"] == 16 and not r["chunked"], r


def test_ulacache_keeps_stocks_prefix_caching_and_may_lower_a_default_batch(resolved):
    """A DSA model under ulacache gets the prefix caching stock would give it (vLLM's, over
    the logical pool): the AMX path's on, the reference path's off, an explicit request on
    any host (the CPU sparse-MLA backend takes it everywhere)."""
    from ulacache_vllm.engine.dsa.sizing import DEFAULTED_KEY

    amx, ref = resolved["ula_amx"], resolved["ula_reference"]
    assert amx["chunked"] and amx["prefix"], amx
    assert not ref["prefix"], ref
    assert resolved["ula_reference_cached"]["prefix"], resolved["ula_reference_cached"]
    assert resolved["ula_host"]["prefix"] == resolved["host"]["prefix"], resolved
    assert DEFAULTED_KEY in amx["extra"]  # max_num_batched_tokens left to vLLM's default
    assert DEFAULTED_KEY not in ref["extra"]  # pinned: never lowered, refused if too big
