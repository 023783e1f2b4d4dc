"""The selection trace (`--ula-trace-path`): each step's appended, selected and freed logical
addresses of every layer group as JSONL, replayed by `benchmarks/pblru_vs_lru.py --trace`.
One file holds one run (it is truncated when opened: two runs' steps would merge on replay).
"""
from __future__ import annotations

import json

import torch


class StepTrace:
    def __init__(self, file=None):
        self.file = file

    @classmethod
    def open(cls, path: str | None, num_logical: int) -> "StepTrace":
        if not path:
            return cls()
        f = open(path, "w")
        f.write(json.dumps({"num_logical": num_logical}) + "\n")
        return cls(f)

    @property
    def on(self) -> bool:
        return self.file is not None

    def record(self, step: int, gid: int, kind: str, addrs: torch.Tensor, reqs=None) -> None:
        if self.file is None or addrs.numel() == 0:
            return
        a = addrs[addrs >= 0]
        rec = {"step": step, "group": gid, "kind": kind,
               "req": reqs.tolist() if reqs is not None else 0, "addr": a.tolist()}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
