"""The `--kv-backend` choice and ulacache settings: names, validation, and where they live.

The choice travels to every vLLM process inside `VllmConfig.additional_config` (vLLM has no
field for it): `{"kv_backend": "ulacache", "ulacache": {...settings...}}`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

KV_BACKENDS = ("vllm", "ulacache")
DEFAULT_KV_BACKEND = "vllm"
ADDITIONAL_CONFIG_KEY = "kv_backend"
SETTINGS_KEY = "ulacache"

# Architectures whose attention is index-based sparse MLA (DSA): ulacache's logical address
# space serves these. Any model whose config carries `index_topk` is treated the same way.
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


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


@dataclass
class UlaSettings:
    """ulacache knobs, given as `--ula-*` flags or `LLM(ula_*=...)` keyword arguments."""

    host_pool_gib: float = 4.0  # host-tier capacity for sparse-MLA KV rows
    lru: str = "pblru"  # victim policy: pblru | pblru_queue | pblru_bitmap | exact_ts | exact_list
    trace_path: str | None = None  # opt-in: write per-step selected logical addresses here
    fast_path: bool = True  # identity placement (no translation) until the device pool overflows

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


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
BOOL_WORDS = _TRUE + _FALSE  # what a boolean setting accepts as a string


def _coerce(name: str, value: Any) -> Any:
    """A setting's value in its field's type: numbers and booleans may come as strings (JSON
    in --additional-config, `LLM(ula_host_pool_gib="8")`); anything else is a KVBackendError
    naming the setting."""
    flag = f"ula_{name} (--ula-{name.replace('_', '-')})"
    if name == "host_pool_gib":
        try:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        except (TypeError, ValueError):
            raise KVBackendError(f"{flag} must be a number of GiB, got {value!r}") from None
        if not out >= 0 or out == float("inf"):
            raise KVBackendError(f"{flag} must be a finite number of GiB >= 0, got {value!r}")
        return out
    if name == "fast_path":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise KVBackendError(f"{flag} must be true or false, got {value!r}")
    if name == "lru":
        if not isinstance(value, str):
            raise KVBackendError(f"{flag} must be a policy name, got {value!r}")
        return value.strip().lower()
    if name == "trace_path":
        if value is not None and not isinstance(value, (str, bytes)) and not hasattr(value, "__fspath__"):
            raise KVBackendError(f"{flag} must be a file path, got {value!r}")
        import os

        return None if value is None else os.fsdecode(value)
    return value


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
    return backend_from_additional_config(getattr(vllm_config, "additional_config", None))


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


def is_dsa_model(hf_config: Any) -> bool:
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if getattr(text, "index_topk", None):
        return True
    archs = getattr(hf_config, "architectures", None) or []
    return any(a in DSA_ARCHITECTURES for a in archs)


def check_model_supported(model_config: Any) -> None:
    """Raises KVBackendError unless ulacache can serve this model."""
    hf_config = model_config.hf_config
    if is_dsa_model(hf_config):
        return
    archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
    raise KVBackendError(
        f"--kv-backend ulacache does not support model architecture {', '.join(archs)}: "
        f"it serves index-based sparse-attention (DSA) models "
        f"({', '.join(DSA_ARCHITECTURES)}, or any model whose config has `index_topk`). "
        f"Use --kv-backend vllm for this model."
    )
