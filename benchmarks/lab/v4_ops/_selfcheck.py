"""The self-check runner the three op modules share (lab only)."""
from __future__ import annotations

from collections.abc import Callable

import torch


def run(label: str, run_checks: Callable[[], list[tuple[str, bool, str]]]) -> None:
    """Runs ``run_checks`` (-> [(name, ok, detail)]) under ``torch.random.fork_rng`` with its
    own seed (the caller's RNG state is restored); raises AssertionError naming every failed
    check; on success prints one summary line."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        results = run_checks()
    failed = [f"{name}: {detail}" if detail else name for name, ok, detail in results if not ok]
    if failed:
        raise AssertionError(f"{label} self-check: {len(failed)} of {len(results)} checks "
                             "failed:\n  " + "\n  ".join(failed))
    print(f"{label} self-check: {len(results)} checks passed")
