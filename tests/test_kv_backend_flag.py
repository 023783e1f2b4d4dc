"""--kv-backend flag, LLM(kv_backend=...) keyword, and the clear errors for bad input."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ulacache_vllm.engine import config as ula_config


@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def test_flag_registered_with_help(parser):
    action = next(a for a in parser._actions if "--kv-backend" in a.option_strings)
    assert set(action.choices) == {"vllm", "ulacache"}
    assert "ulacache" in action.help and "default" in action.help
    assert any("--ula-host-pool-gib" in a.option_strings for a in parser._actions)


def test_setting_flags_check_their_choices(parser, capsys):
    from vllm.engine.arg_utils import AsyncEngineArgs

    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--ula-lru", "fifo"])
    assert "exact_ts" in capsys.readouterr().err
    args = parser.parse_args(["--model", "m", "--kv-backend", "ulacache", "--ula-lru", "EXACT_TS",
                              "--ula-fast-path", "No"])
    cfg = AsyncEngineArgs.from_cli_args(args).additional_config
    assert ula_config.settings_from_additional_config(cfg) == ula_config.UlaSettings(
        lru="exact_ts", fast_path=False)


def test_trace_path_is_checked_before_the_engine_starts(tmp_path):
    from ulacache_vllm.engine.wiring import check_trace_path

    check_trace_path(str(tmp_path / "t.jsonl"))  # a new file in an existing directory
    with pytest.raises(ula_config.KVBackendError, match="is a directory"):
        check_trace_path(str(tmp_path))
    with pytest.raises(ula_config.KVBackendError, match="does not exist"):
        check_trace_path(str(tmp_path / "missing" / "t.jsonl"))


def test_trace_file_per_data_parallel_rank():
    assert ula_config.trace_file_for("/t/x.jsonl", 0, 2) == "/t/x.jsonl"
    assert ula_config.trace_file_for("/t/x.jsonl", 1, 2) == "/t/x.dp1.jsonl"
    assert ula_config.trace_file_for("/t/x.jsonl", 0, 1) == "/t/x.jsonl"


def test_trace_records_a_group_once_per_step_before_resolving():
    """Every layer of a layer group writes and reads the same addresses: the group's writes
    are recorded once, when the step's write slots are fixed before the forward, and its
    selections once per forward pass, by the group's first layer."""
    import json
    from types import SimpleNamespace

    import torch

    from ulacache_vllm.engine.dsa.sizing import UlaLayout
    from ulacache_vllm.engine.dsa.store import UlaWorkerStore

    layers = ["l0", "l1", "l2"]
    layout = UlaLayout(block_size=16, device_slots=64, host_slots=64, num_logical=128,
                       num_blocks=9, mla_layers=layers, leaders=["l0"],
                       mla_row_bytes={n: 32 for n in layers}, mla_head_size=8,
                       mla_dtype="float32", indexer_bytes_per_token=0)
    mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
    import tempfile, os
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "t.jsonl")
        store = UlaWorkerStore(layout, ula_config.UlaSettings(), mods, torch.device("cpu"), path)
        a = torch.tensor([3, 4, -1])
        store.begin_step([], {n: a for n in layers})
        for n in layers:
            t = mods[n].impl.translator
            t.write_slots(n, a)
            t.resolve(n, torch.tensor([[3, 4]]), None)
        store.trace.file.flush()
        lines = [json.loads(x) for x in open(path).read().splitlines()[1:]]
    assert [(x["step"], x["group"], x["kind"], x["addr"]) for x in lines] == [
        (1, 0, "append", [3, 4]), (1, 0, "select", [3, 4])]


def test_flag_translates_into_additional_config(parser):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(["--model", "m", "--kv-backend", "ulacache",
                              "--ula-host-pool-gib", "2.5", "--additional-config",
                              '{"other": 1}'])
    ea = AsyncEngineArgs.from_cli_args(args)
    assert ea.additional_config["kv_backend"] == "ulacache"
    assert ea.additional_config["ulacache"] == {"host_pool_gib": 2.5}
    assert ea.additional_config["other"] == 1
    default = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m"]))
    assert ula_config.backend_from_additional_config(default.additional_config) == "vllm"


def test_invalid_flag_value_lists_choices(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-backend", "bogus"])
    err = capsys.readouterr().err
    assert "bogus" in err and "vllm" in err and "ulacache" in err


def test_unknown_backend_in_additional_config_is_clear():
    with pytest.raises(ula_config.KVBackendError, match="valid choices: vllm, ulacache"):
        ula_config.backend_from_additional_config({"kv_backend": "hisparse"})
    with pytest.raises(ula_config.KVBackendError, match="unknown ulacache setting"):
        ula_config.merge_into_additional_config({}, "ulacache", {"hostpool": 1})


def test_llm_kwargs_split():
    from ulacache_vllm.patches.llm_kwargs import split_kwargs

    kw = {"kv_backend": "ulacache", "ula_host_pool_gib": 1.0, "dtype": "float32"}
    backend, settings = split_kwargs(kw)
    assert backend == "ulacache" and settings == {"host_pool_gib": 1.0}
    assert kw == {"dtype": "float32"}


def test_vllm_serve_help_lists_flag():
    """The installed `vllm` console script works on the CPU build and shows the flag."""
    import shutil

    exe = shutil.which("vllm", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "vllm console script missing from the venv"
    out = subprocess.run([exe, "serve", "--help=ulacache"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--kv-backend" in out.stdout and "--ula-host-pool-gib" in out.stdout


ERRORS_SCRIPT = r"""
from vllm import LLM
res = {}
def attempt(key, **kw):
    try:
        LLM(**{**dict(enforce_eager=True, dtype="float32", max_model_len=512,
                      kv_cache_memory_bytes=64 << 20), **kw})
        res[key] = "no error"
    except Exception as e:
        res[key] = f"{type(e).__name__}: {e}"
attempt("unknown", model=ARGS["dsa"], kv_backend="bogus")
attempt("unsupported", model=ARGS["llama"], kv_backend="ulacache")
attempt("host_small", model=ARGS["dsa"], kv_backend="ulacache", ula_host_pool_gib=0.0001)
attempt("bad_lru", model=ARGS["dsa"], kv_backend="ulacache", ula_lru="fifo")
# Numbers as strings are read as numbers (here: too small, so the host check names them).
attempt("host_str", model=ARGS["dsa"], kv_backend="ulacache", ula_host_pool_gib="0.0001")
attempt("bad_bool", model=ARGS["dsa"], kv_backend="ulacache", ula_fast_path="maybe")
attempt("trace_dir", model=ARGS["dsa"], kv_backend="ulacache",
        ula_trace_path="/nonexistent_ulacache_dir/t.jsonl")
# Found only in the engine core (exact layer specs and budget): the message still comes back.
# On the reference MLA path's schedule on every host (no chunked prefill, 2048-token steps):
# the step it refuses, and the fix it names, depend on the schedule (AMX hosts: chunked
# prefill, a 4096-token default step, which ulacache lowers to fit when it can).
attempt("device_small", model=ARGS["dsa"], kv_backend="ulacache", ula_host_pool_gib=0.01,
        kv_cache_memory_bytes=2_000_000, **ARGS["reference_path"])
# The arena (hybrid models) refuses a separate draft model, before any model loads (n-gram
# and MTP run: tests/test_arena_spec_decode.py).
attempt("arena_spec", model=ARGS["gpt_oss"], kv_backend="ulacache",
        speculative_config={"method": "draft_model", "model": ARGS["gpt_oss"],
                            "num_speculative_tokens": 2})
# Not vLLM's CPU build (the platform says so for this one attempt): refused, naming the fix.
from vllm.platforms import current_platform
current_platform.is_cpu = lambda: False
try:
    attempt("not_cpu", model=ARGS["dsa"], kv_backend="ulacache")
finally:
    del current_platform.is_cpu
res["is_cpu_restored"] = current_platform.is_cpu()
emit(res)
"""


@pytest.mark.engine
def test_clear_errors_from_llm(tiny_model):
    from _vllm_subprocess import mla_path_kwargs, run_vllm_script

    res = run_vllm_script(ERRORS_SCRIPT, args={
        "dsa": str(tiny_model("deepseek_v32")), "llama": str(tiny_model("llama")),
        "gpt_oss": str(tiny_model("gpt_oss", initializer_range=0.1)),
        "reference_path": mla_path_kwargs("reference", 512)}, timeout=300)
    assert "valid choices: vllm, ulacache" in res["unknown"]
    assert "bogus" in res["unknown"]
    assert "LlamaForCausalLM" in res["unsupported"]
    assert "--kv-backend vllm" in res["unsupported"] and "DSA" in res["unsupported"]
    assert "host pool too small" in res["host_small"]
    assert "max_model_len=512" in res["host_small"] and "--ula-host-pool-gib" in res["host_small"]
    assert "fifo" in res["bad_lru"] and "pblru" in res["bad_lru"]
    assert res["host_str"].startswith("KVBackendError") and "host pool too small" in res["host_str"]
    assert "ula_fast_path" in res["bad_bool"] and "true or false" in res["bad_bool"]
    assert res["trace_dir"].startswith("KVBackendError") and "does not exist" in res["trace_dir"]
    dev = res["device_small"]
    assert dev.startswith("KVBackendError: ulacache device pool too small"), dev
    assert "2000000 bytes" in dev and "Raise the KV budget" in dev
    # The arena refuses a separate draft model in the front end, naming the method, the
    # model and both fixes (n-gram with the arena, or the stock backend).
    spec = res["arena_spec"]
    assert spec.startswith("KVBackendError") and "speculative decoding" in spec, spec
    assert "'draft_model'" in spec and "GptOssForCausalLM" in spec, spec
    assert "arena" in spec and "--kv-backend vllm" in spec and '"ngram"' in spec, spec
    # On a platform other than vLLM's CPU build (CUDA), ulacache refuses to start: its
    # translation hook is wired into the CPU sparse-MLA backend only.
    not_cpu = res["not_cpu"]
    assert not_cpu.startswith("KVBackendError") and "CPU build only" in not_cpu, not_cpu
    assert "--kv-backend vllm" in not_cpu, not_cpu
    assert res["is_cpu_restored"] is True


def test_settings_without_the_backend_warn(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.ulacache"):
        ula_config.merge_into_additional_config({}, None, {"host_pool_gib": 1})
    assert "are ignored" in caplog.text and "--kv-backend ulacache" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.ulacache"):
        ula_config.merge_into_additional_config({}, "ulacache", {"host_pool_gib": 1})
    assert "are ignored" not in caplog.text


def test_settings_are_coerced_or_named():
    s = ula_config.UlaSettings.from_dict({"host_pool_gib": "8", "fast_path": "false",
                                          "lru": "EXACT_TS", "trace_path": None})
    assert (s.host_pool_gib, s.fast_path, s.lru) == (8.0, False, "exact_ts")
    assert ula_config.UlaSettings.from_dict({"fast_path": 1}).fast_path is True
    t = ula_config.UlaSettings.from_dict({"tp_mode": "Replicate", "remote_buffer_rows": "256",
                                          "tp_lockstep_check": "yes"})
    assert (t.tp_mode, t.remote_buffer_rows, t.tp_lockstep_check) == ("replicate", 256, True)
    assert ula_config.UlaSettings().tp_mode == "shard"
    assert ula_config.UlaSettings.from_dict(
        {"remote_buffer_min_hit_rate": "0.25"}).remote_buffer_min_hit_rate == 0.25
    assert ula_config.UlaSettings().remote_buffer_min_hit_rate == 0.1
    assert ula_config.UlaSettings().promote_after == 2
    assert ula_config.UlaSettings.from_dict({"promote_after": "1"}).promote_after == 1
    for bad, match in (({"host_pool_gib": "lots"}, "ula_host_pool_gib .*number of GiB"),
                       ({"host_pool_gib": True}, "number of GiB"),
                       ({"host_pool_gib": "nan"}, ">= 0"),
                       ({"fast_path": "maybe"}, "true or false"),
                       ({"lru": 3}, "one of pblru, exact_ts"),
                       ({"tp_mode": "both"}, "ula_tp_mode .*one of shard, replicate"),
                       ({"remote_buffer_rows": 1.5}, "whole number"),
                       ({"remote_buffer_rows": -1}, ">= 0"),
                       ({"promote_after": 0}, "ula_promote_after .*>= 1"),
                       ({"remote_buffer_min_hit_rate": 1.5}, "from 0 to 1"),
                       ({"remote_buffer_min_hit_rate": "often"}, "min_hit_rate .*from 0 to 1"),
                       ({"remote_buffer_min_hit_rate": False}, "from 0 to 1"),
                       ({"trace_path": 5}, "file path")):
        with pytest.raises(ula_config.KVBackendError, match=match):
            ula_config.UlaSettings.from_dict(bad)


def test_mtp_draft_layers_count_for_the_host_pool():
    from types import SimpleNamespace as NS

    from ulacache_vllm.engine.dsa.sizing import _draft_kv_layers

    target = NS()
    draft = NS(hf_text_config=NS(num_nextn_predict_layers=2), get_num_layers=lambda pc: 99)
    cfg = NS(model_config=target, parallel_config=None,
             speculative_config=NS(method="mtp", draft_model_config=draft))
    assert _draft_kv_layers(cfg) == 2
    cfg.speculative_config = NS(method="ngram", draft_model_config=None)
    assert _draft_kv_layers(cfg) == 0
    cfg.speculative_config = None
    assert _draft_kv_layers(cfg) == 0


def test_arena_refuses_speculative_decoding_with_align_mode_prefix_caching():
    """Qwen3-Next (GDN) with a draft and prefix caching: vLLM's 'align' mamba mode copies
    states with a Triton kernel the CPU build lacks (stock fails at the first decode step:
    `benchmarks/results/parity_fuzz.md`); the arena refuses it at start-up, naming both
    fixes. Without the draft, without prefix caching or without align mode it passes."""
    from types import SimpleNamespace as NS

    from ulacache_vllm.engine.arena.sizing import refuse_speculative_in_align_mode

    def cfg(spec=True, caching=True, mode="align"):
        return NS(speculative_config=NS(method="mtp") if spec else None,
                  cache_config=NS(enable_prefix_caching=caching, mamba_cache_mode=mode),
                  model_config=NS(hf_config=NS(architectures=["Qwen3NextForCausalLM"])))

    with pytest.raises(ula_config.KVBackendError) as e:
        refuse_speculative_in_align_mode(cfg())
    msg = str(e.value)
    assert "Qwen3NextForCausalLM" in msg and "precopy_mamba_align_fused_kernel" in msg, msg
    assert "--no-enable-prefix-caching" in msg and "--speculative-config" in msg, msg
    for ok in (cfg(spec=False), cfg(caching=False), cfg(mode="none"), cfg(mode="all")):
        refuse_speculative_in_align_mode(ok)


def test_engine_args_take_the_backend_and_settings_as_keywords():
    """vLLM's convention: every LLM keyword is an EngineArgs field; a programmatic engine
    (AsyncLLM.from_engine_args) chooses the backend the same way, validated the same way."""
    import ulacache_vllm.patches.apply as patches
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    patches.apply_all()
    for cls in (EngineArgs, AsyncEngineArgs):
        ea = cls(model="m", kv_backend="ulacache", ula_host_pool_gib="8", ula_lru="EXACT_TS")
        assert ea.kv_backend == "ulacache" and ea.ula_host_pool_gib == 8.0
        assert ea.ula_lru == "exact_ts" and ea.ula_fast_path is True
        assert ula_config.settings_from_additional_config(ea.additional_config).host_pool_gib == 8.0
        assert cls(model="m").kv_backend == "vllm"
        with pytest.raises(ula_config.KVBackendError, match="valid choices: vllm, ulacache"):
            cls(model="m", kv_backend="nope")
        with pytest.raises(ula_config.KVBackendError, match="unknown ulacache setting"):
            cls(model="m", kv_backend="ulacache", ula_hostpool=1)
        with pytest.raises(ula_config.KVBackendError, match="true or false"):
            cls(model="m", kv_backend="ulacache", ula_fast_path="maybe")


# A fresh interpreter in which vLLM's general plugins never load (VLLM_PLUGINS names none of
# the installed ones): only the import hook (`patches/import_hook.py`, installed as a `.pth`
# file) can have taught EngineArgs / AsyncEngineArgs the keywords. Config only, no model.
ENGINE_ARGS_SCRIPT = r"""
import sys
res = {"vllm_preloaded": "vllm" in sys.modules}
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
import vllm.plugins
res["plugins_loaded_before"] = vllm.plugins.plugins_loaded

def attempt(cls, **kw):
    try:
        a = cls(model=ARGS["model"], **kw)
        return dict(kv_backend=a.kv_backend, additional_config=a.additional_config,
                    host_pool_gib=a.ula_host_pool_gib, lru=a.ula_lru)
    except Exception as e:
        return f"{type(e).__name__}: {e}"

for cls in (EngineArgs, AsyncEngineArgs):
    n = cls.__name__
    res[n] = attempt(cls, kv_backend="ulacache", ula_host_pool_gib=8)
    res[n + ".merged"] = attempt(cls, kv_backend="ulacache", ula_lru="EXACT_TS",
                                 additional_config={"other": 1})
    res[n + ".default"] = attempt(cls)
    res[n + ".bad_backend"] = attempt(cls, kv_backend="bogus")
    res[n + ".bad_lru"] = attempt(cls, kv_backend="ulacache", ula_lru="nope")
    res[n + ".unknown"] = attempt(cls, kv_backend="ulacache", ula_hostpool=1)

def patch_checks():
    # Applying again (as the plugin's apply_all does) wraps nothing twice.
    from ulacache_vllm.patches import engine_args, import_hook
    engine_args.apply()
    engine_args.apply()
    res["wrapped_once"] = [
        getattr(cls.__dict__["__init__"], "__ulacache_patch__", None) == "engine_args"
        and not hasattr(cls.__dict__["__init__"].__ulacache_original__, "__ulacache_patch__")
        for cls in (EngineArgs, AsyncEngineArgs)]
    res["after_reapply"] = attempt(EngineArgs, kv_backend="ulacache", ula_host_pool_gib=8)
    res["hook_targets"] = list(import_hook.TARGETS.get("vllm.engine.arg_utils", ()))
    # Version-checked like every patch: another vLLM fails loudly, naming the patch.
    import vllm
    real, vllm.__version__ = vllm.__version__, "0.31.0"
    try:
        engine_args.apply()
        res["other_version"] = "no error"
    except Exception as e:
        res["other_version"] = f"{type(e).__name__}: {e}"
    vllm.__version__ = real

try:
    patch_checks()
except Exception as e:
    res["patch_checks"] = f"{type(e).__name__}: {e}"
# vLLM ran its plugin loading (in __post_init__) but, as VLLM_PLUGINS asks, not ulacache's.
res["plugin_imported"] = "ulacache_vllm.engine.plugin" in sys.modules
emit(res)
"""


def test_engine_args_take_the_settings_from_the_first_import_of_vllm(tiny_model):
    """`EngineArgs(model, kv_backend=..., ula_*=...)` and `AsyncEngineArgs(...)` work in a fresh
    interpreter before (here: without) vLLM's plugins, validated as `LLM(...)` validates.
    (A local model directory: with the hub offline, vLLM's argument checks may look a bare
    name up and fail.)"""
    from _vllm_subprocess import run_vllm_script

    res = run_vllm_script(ENGINE_ARGS_SCRIPT, args={"model": str(tiny_model("deepseek_v32"))},
                          boots_engine=False, timeout=300,
                          env={"VLLM_PLUGINS": "no_such_plugin"})
    assert not res["vllm_preloaded"] and not res["plugins_loaded_before"]
    for n in ("EngineArgs", "AsyncEngineArgs"):
        assert res[n] == dict(kv_backend="ulacache", host_pool_gib=8.0, lru="pblru",
                              additional_config={"kv_backend": "ulacache",
                                                 "ulacache": {"host_pool_gib": 8}}), res[n]
        merged = res[n + ".merged"]
        assert isinstance(merged, dict), merged
        assert merged["additional_config"] == {"other": 1, "kv_backend": "ulacache",
                                               "ulacache": {"lru": "EXACT_TS"}}
        assert merged["lru"] == "exact_ts"
        assert res[n + ".default"]["kv_backend"] == "vllm", res[n + ".default"]
        bad = res[n + ".bad_backend"]
        assert bad.startswith("KVBackendError") and "'bogus'" in bad
        assert "valid choices: vllm, ulacache" in bad
        bad = res[n + ".bad_lru"]
        assert bad.startswith("KVBackendError") and "ula_lru" in bad and "'nope'" in bad, bad
        bad = res[n + ".unknown"]
        assert bad.startswith("KVBackendError") and "unknown ulacache setting" in bad, bad
        assert "hostpool" in bad
    assert "patch_checks" not in res, res["patch_checks"]
    assert res["wrapped_once"] == [True, True]
    assert res["after_reapply"] == res["EngineArgs"]
    assert res["hook_targets"][0] == "engine_args"
    assert res["other_version"].startswith("VllmHookError") and "'engine_args'" in \
        res["other_version"] and "0.31.0" in res["other_version"]
    assert not res["plugin_imported"]


def test_one_settings_table_drives_flags_help_and_readme(parser):
    """Every UlaSettings field has a flag with its help text and choices, and the README's
    table is the generated one."""
    from pathlib import Path

    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for name, kind, text, _, choices in ula_config.setting_fields():
        action = by_flag[ula_config.flag_of(name)]
        assert action.dest == f"ula_{name}" and text.split(".")[0] in action.help
        if kind == "choice":
            assert set(action.choices) == set(choices)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("<!-- end settings table -->")[0].split("-->\n", 1)[-1].strip()
    table = table[table.index("| flag"):]
    assert table == ula_config.settings_markdown(), \
        "README settings table is stale: paste `python -m ulacache_vllm.engine.config`"


def test_tp_shard_mode_refuses_what_it_does_not_support_yet():
    from types import SimpleNamespace as NS

    from ulacache_vllm.engine.dsa.sizing import check_tp_mode

    def cfg(tp=2, pp=1, dcp=1, spec=None, bs=16):
        return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                     decode_context_parallel_size=dcp,
                                     prefill_context_parallel_size=1),
                  speculative_config=spec, cache_config=NS(block_size=bs))

    shard, rep = ula_config.UlaSettings(), ula_config.UlaSettings(tp_mode="replicate")
    check_tp_mode(cfg(), shard)
    check_tp_mode(cfg(tp=1, pp=2), shard)  # TP=1: nothing is sharded
    check_tp_mode(cfg(spec=NS(method="mtp")), shard)  # speculative decoding runs sharded
    for bad, match in ((cfg(pp=2), "pipeline parallelism"),
                       (cfg(dcp=2), "decode_context_parallel_size"),
                       (cfg(tp=3), "--block-size 48")):
        with pytest.raises(ula_config.KVBackendError, match=match) as e:
            check_tp_mode(bad, shard)
        assert "--ula-tp-mode replicate" in str(e.value)
        check_tp_mode(bad, rep)  # replicate runs them as before


def test_layer_hooks_are_skipped_for_ulacache_connector_only(monkeypatch):
    """The attention layers' per-layer connector hooks (`maybe_transfer_kv_layer`) see a
    transfer group for every connector but ulacache's (`patches/kv_layer_hooks`), and the
    patch fails loudly when the wrapper no longer reads the name per call."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state
    import vllm.model_executor.layers.attention.kv_transfer_utils as ktu

    from ulacache_vllm.engine.connector import UlaCacheConnector
    from ulacache_vllm.patches import kv_layer_hooks
    from ulacache_vllm.patches._hook import VllmHookError

    kv_layer_hooks.apply()
    monkeypatch.setattr(state, "_KV_CONNECTOR_AGENT", None)
    assert not ktu.has_kv_transfer_group()
    monkeypatch.setattr(state, "_KV_CONNECTOR_AGENT", object.__new__(UlaCacheConnector))
    assert not ktu.has_kv_transfer_group()
    monkeypatch.setattr(state, "_KV_CONNECTOR_AGENT", object())  # any other connector
    assert ktu.has_kv_transfer_group()

    def moved(func):
        def wrapper(*a, **k):
            return func(*a, **k)
        return wrapper

    monkeypatch.setattr(ktu, "maybe_transfer_kv_layer", moved)
    monkeypatch.setattr(ktu, "has_kv_transfer_group", state.has_kv_transfer_group)
    with pytest.raises(VllmHookError, match="kv_layer_hooks"):
        kv_layer_hooks.apply()
