"""The `--kv-backend` choice and ulacache settings: names, validation, and where they live.

The choice travels to every vLLM process inside `VllmConfig.additional_config` (vLLM has no
field for it): `{"kv_backend": "ulacache", "ulacache": {...settings...}}`, with the product
line chosen for the model (`lines.LINE_KEY`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

KV_BACKENDS = ("vllm", "ulacache")
TP_MODES = ("shard", "replicate")
DEFAULT_KV_BACKEND = "vllm"
ADDITIONAL_CONFIG_KEY = "kv_backend"
SETTINGS_KEY = "ulacache"
# (The product line chosen for the model travels beside them: `lines.LINE_KEY`.)

# The experimental CUDA opt-in: a line that runs on CUDA (`Line.runs_on_cuda`) does so only
# with this set to 1; without it every line is refused on a non-CPU platform.
EXPERIMENTAL_CUDA_ENV = "ULACACHE_EXPERIMENTAL_CUDA"


def experimental_cuda_enabled() -> bool:
    """True only for an explicit ``ULACACHE_EXPERIMENTAL_CUDA=1`` (anything else: refused)."""
    return os.environ.get(EXPERIMENTAL_CUDA_ENV, "").strip() == "1"


class KVBackendError(ValueError):
    """A bad `--kv-backend` request: the message names the problem and the fix."""


# Checks that need the engine core's exact layer specs and KV budget (device pool too small,
# ...) fail in the engine-core process, whose exception the front end only sees as vLLM's
# "Engine core initialization failed"; the message travels back through this file (its path
# is set in the front end before the engine processes start, which inherit it).
ERROR_FILE_ENV = "ULACACHE_ERROR_FILE"


def report_engine_error(err: KVBackendError) -> None:
    """Engine-core side: leave ``err``'s message for the front end."""
    import os

    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(str(err))
        except OSError:
            pass  # the engine log still has the message


class reported_to_front_end:
    """``with reported_to_front_end(): ...`` in the engine core: a KVBackendError raised inside
    is left for the front end (`report_engine_error`) and re-raised."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if isinstance(err, KVBackendError):
            report_engine_error(err)
        return False


def take_engine_error() -> str | None:
    """Front-end side: the message an engine core left, if any (read once)."""
    import os

    path = os.environ.get(ERROR_FILE_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            msg = f.read().strip()
        os.unlink(path)
    except OSError:
        return None
    return msg or None


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
BOOL_WORDS = _TRUE + _FALSE  # what a boolean setting accepts as a string


def _lru_choices() -> tuple[str, ...]:
    from ulacache_vllm.core.policies import POLICIES

    return tuple(POLICIES)


def _setting(default: Any, kind: str, help: str, metavar: str = "", choices=None,
             minimum: int = 0, debug: bool = False):
    """A UlaSettings field. ``kind`` (gib | fraction | int | bool | choice | path) decides
    coercion and the CLI flag's type; ``help`` is the flag's help and the README's text;
    ``choices`` is a callable (the policies live in the core, imported only when asked);
    ``minimum``: the smallest value an int setting takes; ``debug``: a debugging or testing
    knob (off by default, greedy output unchanged), listed apart from the product's settings."""
    if debug:
        help = "[debugging, harmless] " + help
    return field(default=default, metadata=dict(kind=kind, help=help, metavar=metavar,
                                                choices=choices, minimum=minimum, debug=debug))


@dataclass
class UlaSettings:
    """ulacache settings: the one table behind `--ula-*` flags (and their `--help`),
    `LLM(ula_*=...)` / `EngineArgs(ula_*=...)` keywords, coercion and the README's table."""

    host_pool_gib: float = _setting(
        4.0, "gib", "host-memory pool for sparse-MLA rows (DSA models) and DeepSeek-V4's CSA "
        "compressed rows, in GiB (default 4). Must hold one request of `max_model_len`; startup "
        "fails with the numbers otherwise.", metavar="G")
    lru: str = _setting(
        "pblru", "choice", "device-pool victim policy: `pblru` (default, round-label PB-LRU) "
        "or `exact_ts` (an exact LRU, timestamp scan). The benchmarks' other baselines live "
        "in `benchmarks/lab`.", choices=_lru_choices)
    trace_path: str | None = _setting(
        None, "path", "record each step's appended / selected / freed logical addresses "
        "(JSONL) for `benchmarks/pblru_vs_lru.py --trace FILE`. The file is overwritten at "
        "startup; data-parallel rank R > 0 writes `FILE.dpR.EXT`. Its directory must exist "
        "(checked before the model loads).", metavar="FILE")
    promote_after: int = _setting(
        2, "int", "promote a host row to the device pool only after it was read in this many "
        "steps in a row (default 2; 1 promotes every host row read). Rows read once, as an "
        "indexer whose top-k moves reads most of its rows, then cost no promotion and no "
        "later demotion; they are read where they are (in place on the CPU build, staged on "
        "CUDA). Rows read again are promoted one step later.", metavar="K", minimum=1)
    fast_path: bool = _setting(
        True, "bool", "identity placement (no translation, no copies) until the device pool "
        "first overflows (default true).")
    tp_mode: str = _setting(
        "shard", "choice", "with `--tensor-parallel-size P > 1`: `shard` (default; token t's "
        "MLA row and indexer key live on rank t mod P only, so P ranks hold P times the "
        "tokens; remote rows are fetched through the TP group into a buffer of recent ones) "
        "or `replicate` (every rank holds every row, as stock vLLM). `shard` needs "
        "`block_size % P == 0` and refuses pipeline and context parallelism.", choices=lambda: TP_MODES)
    remote_buffer_rows: int = _setting(
        0, "int", "TP shard mode: rows per rank and layer group of the buffer of recently "
        "fetched remote rows (default 0: `max_num_seqs * index_topk`, at most 1/32 of the "
        "device rows).", metavar="N")
    remote_buffer_min_hit_rate: float = _setting(
        0.1, "fraction", "TP shard mode: fill the buffer of fetched remote rows only while at "
        "least this share of the reads hit it (a running average; every 16th step fills "
        "anyway, to notice reuse coming back). A buffer the reads seldom hit costs a settle a "
        "step and saves almost no fetch. Default 0.1; 0 fills on every step.", metavar="R")
    tp_lockstep_check: bool = _setting(
        False, "bool", "TP shard mode: before each exchange the ranks compare a (step, op, "
        "layer) tag and raise on a mismatch instead of hanging (default false).", debug=True)
    v4_csa_device_rows: int = _setting(
        0, "int", "DeepSeek-V4: compressed rows per CSA layer kept in the device pool (default "
        "0: one step's new rows plus one request's top-k, `max_num_batched_tokens / 4 + "
        "max_num_seqs + index_topk`); the other rows live in the host pool "
        "(`--ula-host-pool-gib`), read in place on the CPU build and promoted when read again. "
        "At least one step's new rows.", metavar="N")
    arena_force_moves: int = _setting(
        0, "int", "hybrid models (arena): every N scheduler steps compact and relayout the "
        "arena whether or not an admission needs it, with real copies, to exercise the moves "
        "(default 0: only when an admission needs room). Output is unchanged; it costs copies.",
        metavar="N", debug=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "UlaSettings":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise KVBackendError(
                f"unknown ulacache setting(s) {unknown}; valid settings: {sorted(known)}"
            )
        return cls(**{k: _coerce(k, v) for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def setting_fields(debug: bool | None = None):
    """(name, kind, help, metavar, choices tuple or None) of every setting, in table order;
    ``debug``: only the debugging knobs (True) or only the product's settings (False)."""
    for f in fields(UlaSettings):
        md = f.metadata
        if debug is not None and md["debug"] != debug:
            continue
        choices = md["choices"]() if md["choices"] else (("true", "false") if md["kind"] == "bool" else None)
        yield f.name, md["kind"], md["help"], md["metavar"], choices


def flag_of(name: str) -> str:
    return "--ula-" + name.replace("_", "-")


BACKEND_HELP = ("`vllm`: stock block manager (default). `ulacache`: logical address space over "
                "device + host for DSA models; one arena at natural page sizes for hybrid "
                "models (Qwen3-Next, GPT-OSS, Gemma 3) and DeepSeek-V4.")
# Environment knobs beside the settings (read where they act; listed in the same table).
ENV_KNOBS = {
    "ULACACHE_PBLRU_SMALL_POOL_SLOTS": "PB-LRU pools up to this many slots (default 4096) "
    "pick victims by one timestamp top-k (exact LRU; cheaper for small pools).",
}
DEBUG_ENV_KNOBS = {
    "ULACACHE_TEST_MOVE_FAULTS": "testing only: a JSON file that makes the worker's copies "
    "raise or stall: tier row copies (DSA), arena page moves (hybrid models and DeepSeek-V4) "
    "and DeepSeek-V4's CSA row copies (`ulacache_vllm/engine/faults.py`). A failed copy ends the requests whose KV it "
    "lost with an error; the others are unaffected.",
}


def settings_markdown() -> str:
    """The README's settings table, generated from UlaSettings (`python -m
    ulacache_vllm.engine.config` prints it)."""
    rows = ["| flag (`LLM` / `EngineArgs` keyword) | meaning |", "|---|---|",
            f"| `--kv-backend {{{','.join(KV_BACKENDS)}}}` (`kv_backend`) | {BACKEND_HELP} |"]
    for debug in (False, True):
        if debug:
            rows += ["", "Debugging and testing knobs (off by default; none changes the output):",
                     "", "| flag / env | meaning |", "|---|---|"]
        for name, kind, text, metavar, choices in setting_fields(debug):
            arg = "{" + ",".join(choices) + "}" if choices else metavar
            rows.append(f"| `{flag_of(name)} {arg}` (`ula_{name}`) | {text} |")
        knobs = DEBUG_ENV_KNOBS if debug else ENV_KNOBS
        rows += [f"| env `{k}` | {v} |" for k, v in knobs.items()]
    return "\n".join(rows)


def _coerce(name: str, value: Any) -> Any:
    """A setting's value in its field's type, by the field's kind: numbers and booleans may
    come as strings (JSON in --additional-config, `LLM(ula_host_pool_gib="8")`); anything
    else is a KVBackendError naming the setting."""
    flag = f"ula_{name} ({flag_of(name)})"
    kind = UlaSettings.__dataclass_fields__[name].metadata["kind"]
    if kind in ("gib", "fraction"):
        # (what a bad value is told it must be, whether a parsed number is in range)
        what, ok = {"gib": ("a finite number of GiB >= 0", lambda x: 0 <= x < float("inf")),
                    "fraction": ("a number from 0 to 1", lambda x: 0.0 <= x <= 1.0)}[kind]
        try:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        except (TypeError, ValueError):
            raise KVBackendError(f"{flag} must be {what}, got {value!r}") from None
        if not ok(out):  # (nan fails every comparison)
            raise KVBackendError(f"{flag} must be {what}, got {value!r}")
        return out
    if kind == "int":
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value)
        except (TypeError, ValueError):
            raise KVBackendError(f"{flag} must be a whole number, got {value!r}") from None
        least = UlaSettings.__dataclass_fields__[name].metadata["minimum"]
        if out < least:
            raise KVBackendError(f"{flag} must be >= {least}, got {value!r}")
        return out
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise KVBackendError(f"{flag} must be true or false, got {value!r}")
    if kind == "choice":
        choices = UlaSettings.__dataclass_fields__[name].metadata["choices"]()
        if not isinstance(value, str):
            raise KVBackendError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        v = value.strip().lower()
        if v not in choices:
            raise KVBackendError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        return v
    if kind == "path":
        if value is not None and not isinstance(value, (str, bytes)) and not hasattr(value, "__fspath__"):
            raise KVBackendError(f"{flag} must be a file path, got {value!r}")
        import os

        return None if value is None else os.fsdecode(value)
    raise AssertionError(f"setting {name} has unknown kind {kind!r}")


def trace_file_for(path: str, dp_rank: int, dp_size: int) -> str:
    """The trace file one engine writes: ``path`` itself, or ``stem.dpR.ext`` for data-parallel
    rank R > 0 (each rank has its own pools, so its trace replays on its own)."""
    if dp_size <= 1 or dp_rank == 0:
        return path
    import os

    root, ext = os.path.splitext(path)
    return f"{root}.dp{dp_rank}{ext}"


def validate_backend_name(name: Any) -> str:
    if not isinstance(name, str) or name.strip().lower() not in KV_BACKENDS:
        raise KVBackendError(
            f"unknown --kv-backend {name!r}; valid choices: {', '.join(KV_BACKENDS)} "
            f"(default: {DEFAULT_KV_BACKEND})"
        )
    return name.strip().lower()


def backend_from_additional_config(additional_config: dict | None) -> str:
    if not additional_config:
        return DEFAULT_KV_BACKEND
    return validate_backend_name(additional_config.get(ADDITIONAL_CONFIG_KEY, DEFAULT_KV_BACKEND))


def settings_from_additional_config(additional_config: dict | None) -> UlaSettings:
    return UlaSettings.from_dict((additional_config or {}).get(SETTINGS_KEY))


def kv_backend_of(vllm_config: Any) -> str:
    return backend_from_additional_config(vllm_config.additional_config)


def merge_into_additional_config(
    additional_config: dict | None, backend: str | None, settings: dict[str, Any]
) -> dict:
    out = dict(additional_config or {})
    if backend is not None:
        out[ADDITIONAL_CONFIG_KEY] = validate_backend_name(backend)
    if settings:
        merged = dict(out.get(SETTINGS_KEY) or {})
        merged.update(settings)
        UlaSettings.from_dict(merged)  # validate early, with a clear message
        out[SETTINGS_KEY] = merged
        if out.get(ADDITIONAL_CONFIG_KEY, DEFAULT_KV_BACKEND) != "ulacache":
            import logging

            logging.getLogger("vllm.ulacache").warning(
                "ulacache settings %s are ignored: the KV backend is %r; add "
                "--kv-backend ulacache (LLM(kv_backend=\"ulacache\")) to use them",
                sorted(settings), out.get(ADDITIONAL_CONFIG_KEY, DEFAULT_KV_BACKEND))
    return out


def refuse_kv_offloading(engine_args: Any) -> None:
    """`--kv-offloading-size` (vLLM's OffloadingConnector, a host prefix tier) next to
    `--kv-backend ulacache`: vLLM would swap ulacache's connector for its own, and ulacache's
    host pool already is the host tier (cached prefixes included)."""
    size = getattr(engine_args, "kv_offloading_size", None)
    if size is not None:
        raise KVBackendError(
            f"--kv-backend ulacache cannot be combined with --kv-offloading-size {size} "
            f"(vLLM's OffloadingConnector): ulacache brings its own KV connector, and its host "
            f"pool already is the host tier of the KV cache, cached prefixes included. Drop "
            f"--kv-offloading-size and size the host tier with --ula-host-pool-gib instead.")


def refuse_context_parallel(pc: Any, who: str, why: str) -> None:
    """Context parallelism (decode or prefill) is refused by ``who``; ``why`` ends the message."""
    for what in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(pc, what, 1) or 1) > 1:
            raise KVBackendError(f"{who} does not support {what} > 1{why}")


if __name__ == "__main__":
    print(settings_markdown())
