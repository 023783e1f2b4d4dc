"""Hook: `EngineArgs.add_cli_args` / `EngineArgs.from_cli_args` (engine/arg_utils.py).

vLLM has no hook for extra engine arguments and `from_cli_args` copies only dataclass fields,
so `--kv-backend` and the `--ula-*` settings are added to the parser here and translated into
`additional_config` (which reaches the engine-core and worker processes inside VllmConfig).
"""
from __future__ import annotations

import argparse

from ulacache_vllm.engine import config as ula_config

from ._hook import replace

HOOK = "cli_args"
MODULE = "vllm.engine.arg_utils"

# CLI type of each setting kind (the values are coerced again, with named errors, by
# UlaSettings.from_dict).
_KIND_TYPE = {"gib": float, "fraction": float, "int": int, "bool": str.lower, "choice": str.lower, "path": str}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    if any("--kv-backend" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group(
        "ulacache", "KV-cache backend selection (added by the ulacache_vllm plugin)."
    )
    group.add_argument(
        "--kv-backend",
        dest="kv_backend",
        default=None,
        choices=list(ula_config.KV_BACKENDS),
        help="KV-cache backend: 'vllm' (stock block manager, the default) or 'ulacache' "
        "(unified logical KV address space over device and host memory with PB-LRU "
        "eviction, for DSA sparse-attention models such as DeepSeek-V3.2 and GLM-5).",
    )
    for name, kind, text, metavar, choices in ula_config.setting_fields():
        if kind == "bool":
            choices = ula_config.BOOL_WORDS
        group.add_argument(ula_config.flag_of(name), dest=f"ula_{name}", type=_KIND_TYPE[kind],
                           default=None, choices=list(choices) if choices else None,
                           metavar=metavar or None, help="ulacache: " + text.replace("%", "%%"))


def settings_from_namespace(args: argparse.Namespace) -> dict:
    return {name: getattr(args, f"ula_{name}") for name, *_ in ula_config.setting_fields()
            if getattr(args, f"ula_{name}", None) is not None}


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig_add = EngineArgs.add_cli_args
    orig_from = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser, *args, **kwargs):
        parser = orig_add(parser, *args, **kwargs)
        _add_arguments(parser)
        return parser

    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        backend = getattr(args, "kv_backend", None)
        settings = settings_from_namespace(args)
        if backend is not None or settings:
            engine_args.additional_config = ula_config.merge_into_additional_config(
                engine_args.additional_config, backend, settings
            )
        return engine_args

    replace(MODULE, "EngineArgs.add_cli_args", staticmethod(add_cli_args), HOOK)
    replace(MODULE, "EngineArgs.from_cli_args", classmethod(from_cli_args), HOOK)
