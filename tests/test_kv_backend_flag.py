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
        store._trace.flush()
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
attempt("device_small", model=ARGS["dsa"], kv_backend="ulacache", ula_host_pool_gib=0.01,
        kv_cache_memory_bytes=2_000_000)
emit(res)
"""


@pytest.mark.engine
def test_clear_errors_from_llm(tiny_model):
    from _vllm_subprocess import run_vllm_script

    res = run_vllm_script(ERRORS_SCRIPT, args={"dsa": str(tiny_model("deepseek_v32")),
                                               "llama": str(tiny_model("llama"))}, timeout=300)
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
    for bad, match in (({"host_pool_gib": "lots"}, "ula_host_pool_gib .*number of GiB"),
                       ({"host_pool_gib": True}, "number of GiB"),
                       ({"host_pool_gib": "nan"}, ">= 0"),
                       ({"fast_path": "maybe"}, "true or false"),
                       ({"lru": 3}, "one of pblru, exact_ts"),
                       ({"tp_mode": "both"}, "ula_tp_mode .*one of shard, replicate"),
                       ({"remote_buffer_rows": 1.5}, "whole number"),
                       ({"remote_buffer_rows": -1}, ">= 0"),
                       ({"trace_path": 5}, "file path")):
        with pytest.raises(ula_config.KVBackendError, match=match):
            ula_config.UlaSettings.from_dict(bad)


def test_mtp_draft_layers_count_for_the_host_pool():
    from types import SimpleNamespace as NS

    from ulacache_vllm.engine.wiring import _draft_kv_layers

    target = NS()
    draft = NS(hf_text_config=NS(num_nextn_predict_layers=2), get_num_layers=lambda pc: 99)
    cfg = NS(model_config=target, parallel_config=None,
             speculative_config=NS(method="mtp", draft_model_config=draft))
    assert _draft_kv_layers(cfg) == 2
    cfg.speculative_config = NS(method="ngram", draft_model_config=None)
    assert _draft_kv_layers(cfg) == 0
    cfg.speculative_config = None
    assert _draft_kv_layers(cfg) == 0


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

    from ulacache_vllm.engine.wiring import check_tp_mode

    def cfg(tp=2, pp=1, dcp=1, spec=None, bs=16):
        return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                     decode_context_parallel_size=dcp,
                                     prefill_context_parallel_size=1),
                  speculative_config=spec, cache_config=NS(block_size=bs))

    shard, rep = ula_config.UlaSettings(), ula_config.UlaSettings(tp_mode="replicate")
    check_tp_mode(cfg(), shard)
    check_tp_mode(cfg(tp=1, pp=2), shard)  # TP=1: nothing is sharded
    for bad, match in ((cfg(pp=2), "pipeline parallelism"),
                       (cfg(dcp=2), "decode_context_parallel_size"),
                       (cfg(spec=NS(method="mtp")), "speculative decoding"),
                       (cfg(tp=3), "--block-size 48")):
        with pytest.raises(ula_config.KVBackendError, match=match) as e:
            check_tp_mode(bad, shard)
        assert "--ula-tp-mode replicate" in str(e.value)
        check_tp_mode(bad, rep)  # replicate runs them as before
