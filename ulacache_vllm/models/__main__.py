"""CLI: ``python -m ulacache_vllm.models list`` / ``build NAME OUTDIR [--seed N] [--set k=v]``."""

from __future__ import annotations

import argparse
import json
import sys


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key] = json.loads(raw)  # numbers, booleans, lists
        except json.JSONDecodeError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    from .configs import FAMILIES
    from .factory import ALL_MODEL_NAMES, DIRECT

    p = argparse.ArgumentParser(prog="python -m ulacache_vllm.models")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list model families")
    b = sub.add_parser("build", help="build a tiny model directory")
    b.add_argument("name", choices=ALL_MODEL_NAMES)
    b.add_argument("outdir")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (value parsed as JSON when possible)")
    b.add_argument("--weights-from", default=None,
                   help="take shapes and weights from this checkpoint (e.g. a DSA model)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for n in ALL_MODEL_NAMES:
            if n in DIRECT:
                print(f"{n}\t{DIRECT[n].ARCHITECTURE}\tstock vLLM CPU path (AVX512-BF16)")
                continue
            f = FAMILIES[n]
            tag = "\tDSA (needs the ulacache CPU sparse-MLA backend)" if f.dsa else ""
            print(f"{n}\t{f.architecture}{tag}")
        return 0
    from .deepseek_v4 import V4ConfigError
    from .factory import build_model

    try:
        path = build_model(args.name, args.outdir, overrides=_parse_set(args.set),
                           seed=args.seed, weights_from=args.weights_from)
    except V4ConfigError as e:  # a shape the CPU kernels refuse: say which, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
