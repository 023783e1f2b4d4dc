"""``--spec METHOD[:K]`` of the benchmarks, as vLLM's ``speculative_config``: the same settings
on stock and ulacache (mtp: the model's own MTP layer, 2 tokens by default; ngram: prompt
lookup, 3 tokens by default)."""
from __future__ import annotations


def spec_config(arg: str | None) -> dict:
    """The speculative_config for ``arg`` ({} without one); exits naming the methods."""
    if not arg:
        return {}
    method, _, k = arg.partition(":")
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": int(k or 2)}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k or 3),
                "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    raise SystemExit(f"--spec {arg}: method must be mtp or ngram")
