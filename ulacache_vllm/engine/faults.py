"""Test-only fault injection in the worker's move path. Off by default; nothing here runs
unless a test turns it on.

Three movers ask their ``faults`` before each copy; ``None`` (the default) costs one attribute
test:

* the DSA worker store's row copies between tiers (`moves.TierMoves.copy_fn`: demotions device
  -> host, promotions host -> device, and the staging copies of a promotion into a full host
  pool);
* the hybrid arena's page moves (`ArenaWorker.apply`: each copy step of a compaction or
  relayout, move ``"arena"``);
* DeepSeek-V4's CSA row copies between tiers (`v4.rows.CsaLayerRows`: ``"demote"``,
  ``"promote"``, ``"stage"``, as the DSA store's).

A fault makes a copy raise `MoveFaultError` (what a failed transfer would do) or sleep first
(a stalled one). What the mover does about a failed copy is the product's behaviour, not this
module's: see `moves.TierMoves.apply`, `ArenaWorker.apply` and `v4.rows` (the requests whose
KV was lost end with an error; nobody else notices).

Two ways to arm it:

* in-process (unit tests): ``store.faults = MoveFaults(fault="raise", count=1)``;
* in an engine (`vllm serve`, `LLM`): start it with ``ULACACHE_TEST_MOVE_FAULTS=/path/x.json``
  in its environment (the workers inherit it). Before each copy the mover re-reads the file
  and, when it changed, arms what it says (a missing or empty file: no faults); steps without
  copies never look at it, and without the variable nothing is polled at all::

      {"fault": "raise" | "stall", "moves": ["demote", "promote", "stage", "arena"],
       "skip": 0, "count": 1, "seconds": 1.0, "nonce": 7}

  ``moves``: which copies qualify (default all); ``skip``: qualifying copies let through
  first; ``count``: qualifying copies affected (-1: every one); ``seconds``: a stall's length;
  ``nonce``: any value, so that writing the same fault again re-arms it. Every worker process
  (each TP rank) arms its own copy of the spec.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

# (vLLM's init_logger is this; plain logging keeps the module importable without vLLM.)
logger = logging.getLogger("vllm.ulacache.faults")
ENV = "ULACACHE_TEST_MOVE_FAULTS"
MOVES = ("demote", "promote", "stage", "arena")
KINDS = ("raise", "stall")


class MoveFaultError(RuntimeError):
    """An injected copy failure (never raised unless a test armed a fault)."""


@dataclass
class MoveFaults:
    fault: str = "raise"
    moves: tuple[str, ...] = MOVES
    skip: int = 0
    count: int = 1
    seconds: float = 1.0
    fired: int = 0  # copies this spec affected so far
    path: str | None = None  # the control file (engine use), re-read by `poll`
    _seen: str | None = None

    def __post_init__(self):
        if self.fault not in KINDS:
            raise ValueError(f"move fault must be one of {KINDS}, got {self.fault!r}")
        bad = set(self.moves) - set(MOVES)
        if bad:
            raise ValueError(f"unknown moves {sorted(bad)}; valid: {MOVES}")
        self.moves = tuple(self.moves)

    @classmethod
    def from_env(cls) -> MoveFaults | None:
        """The engine's hook: None (no faults, the default) unless `ENV` names a control file;
        then a disarmed spec that `poll` arms from the file."""
        path = os.environ.get(ENV)
        if not path:
            return None
        return cls(count=0, path=path)

    def poll(self) -> None:
        """Re-arms from the control file when its text changed (before each copy)."""
        if self.path is None:
            return
        try:
            with open(self.path) as f:
                text = f.read()
        except OSError:
            text = ""
        if text == self._seen:
            return
        self._seen = text
        spec = json.loads(text) if text.strip() else {"count": 0}
        spec.pop("nonce", None)
        armed = MoveFaults(**{**spec, "path": self.path})
        self.fault, self.moves, self.skip, self.count, self.seconds = (
            armed.fault, armed.moves, armed.skip, armed.count, armed.seconds)
        self.fired = 0

    def before_copy(self, move: str, rows: int) -> bool:
        """Called by a mover before each copy of ``rows`` rows or pages (``move`` in MOVES);
        True if it stalled the copy, raises if it failed it. In an engine it first re-reads
        the control file (`poll`): only steps that copy pay for it, and only when armed."""
        self.poll()
        if self.count == 0 or move not in self.moves:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        if self.count > 0:
            self.count -= 1
        self.fired += 1
        if self.fault == "stall":
            logger.warning("ulacache test fault (%s): stalling a %s copy of %d rows for %.2f s",
                           ENV, move, rows, self.seconds)
            time.sleep(self.seconds)
            return True
        raise MoveFaultError(f"ulacache test fault ({ENV}): {move} copy of {rows} rows failed")
