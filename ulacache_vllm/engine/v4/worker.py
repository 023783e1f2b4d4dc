"""The v4 line's worker half: the arena's worker for every V4 cache but the CSA rows, the
CSA rows' store (`rows.CsaRows`) bound to the CSA layers (`patches.v4_csa_rows.bind`), and the
compressors' step scratch for transient state pages (`states.py`,
`patches.v4_state_scratch.bind`).

Per step: the arena's plan lands before vLLM commits its block tables (`before_step`); the
CSA group's block table keeps vLLM's logical block ids (its rows are placed by the mapping
tables, not by granules) and the dead CSA blocks' rows are freed; before the forward
(`begin_step`) the CSA store settles the previous step's selections and places this step's
writes, read from the step's CSA metadata (the slot mapping vLLM computed from the logical
block table), and, for each compressor-state kind with transient pages this step, the
scratch plan every compressor of the kind follows.

Lost blocks (`take_lost`): the arena's lost pages (vids, >= 0) and the CSA pool's logical
blocks whose rows a failed copy lost, as ``csa_lost_id(block)`` (< 0: the two id spaces
overlap); `V4KVCacheManager.lost_block_owners` tells them apart.
"""
from __future__ import annotations

from ..arena.worker import ArenaWorker
from ..metrics import UlaStats, per_rank_gauges
from .rows import CsaRows
from .states import is_state_group, scratch_plan, step_positions

SWA_SUFFIX = ".swa_cache"  # vLLM's V4 names every layer's sliding-window cache so


def csa_lost_id(block: int) -> int:
    """How a lost CSA logical block travels among the step's lost block ids (module doc)."""
    return -1 - block


class V4Worker(ArenaWorker):
    def __init__(self, layout, kv_caches: dict, vllm_config, settings, faults=None) -> None:
        from ulacache_vllm.patches.v4_csa_rows import bind

        csa = layout.csa
        arena_caches = {n: t for n, t in kv_caches.items() if n not in csa.layer_names}
        super().__init__(layout, arena_caches, faults)
        self.csa = CsaRows(csa, settings.lru, settings.promote_after, faults)
        self._ctx = vllm_config.compilation_config.static_forward_context
        self._bind = bind
        self._bound = False  # at the first step: vLLM's init checks the views it made
        self._csa_name = csa.layer_names[0]
        self._csa_sent: dict = {}
        self._freed = None  # the last payload whose dead blocks were freed
        # Compressor states: each state group's layer names, the step's plans by state cache
        # prefix (`patches.v4_state_scratch`), and the compress ratio of each one's compressor.
        self._state_groups = [g.layer_names for g in layout.groups
                              if is_state_group(g.layer_names)]
        self._swa_name = next((n for g in layout.groups for n in g.layer_names
                               if n.endswith(SWA_SUFFIX)), None)
        self._plans: dict = {}
        self._ratios: dict = {}
        self.state_scratch_tokens = 0  # tokens whose state stayed in the step scratch
        self._scratch = None  # (bound at the first step)

    def _bind_all(self) -> None:
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        from ulacache_vllm.patches.v4_state_scratch import Scratch
        from ulacache_vllm.patches.v4_state_scratch import bind as bind_scratch

        scratch = self._scratch = Scratch()
        for layer in self._ctx.values():  # the scratch first: the CSA rows' wrapper on top
            if isinstance(layer, DeepseekV4CPUAttention) and layer.compress_ratio > 1:
                comps = [layer.compressor]
                if getattr(layer, "indexer", None) is not None:
                    comps.append(layer.indexer.compressor)
                for comp in comps:
                    bind_scratch(comp, self._plans, scratch)
                    self._ratios[comp.state_cache.prefix] = comp.compress_ratio
        for name, rows in self.csa.layers.items():
            self._bind(self._ctx[name], rows)

    def before_step(self, payload) -> None:
        if not self._bound:
            self._bind_all()
            self._bound = True
        self._free(payload)
        super().before_step(payload.plan)

    def _free(self, payload) -> None:
        """The payload's dead CSA blocks' rows, freed once (a step without a forward reaches
        only `begin_step`)."""
        if payload is not self._freed:
            self._freed = payload
            self.csa.free(payload.csa_dead)

    def commit_block_table(self, block_table, num_reqs: int) -> bool:
        if getattr(block_table, "ula_group", None) == self.layout.csa.group:
            return False  # logical block ids: vLLM's own copy
        return super().commit_block_table(block_table, num_reqs)

    def begin_step(self, payload, forward_context) -> None:
        self._free(payload)
        md = forward_context.attn_metadata
        slots = None
        if isinstance(md, dict) and self._csa_name in md:
            slots = md[self._csa_name].slot_mapping
        self.csa.begin(slots)
        self._plan_states(md)

    def _plan_states(self, md) -> None:
        """This step's scratch plan of every state kind with transient pages (outside the
        forward: the compressors only follow it)."""
        self._plans.clear()
        if not isinstance(md, dict) or self._swa_name not in md or not self._state_groups:
            return
        swa = md[self._swa_name]
        positions = None
        for names in self._state_groups:
            sm = md.get(names[0])
            if sm is None or sm.token_to_req_indices is None:
                continue
            T = sm.slot_mapping.shape[0]
            if positions is None:
                positions = step_positions(swa.query_start_loc_cpu, swa.seq_lens.cpu(),
                                           sm.token_to_req_indices[:T])
            window = self._ctx[names[0]].sliding_window
            plan = scratch_plan(sm.slot_mapping, sm.block_table, sm.block_size,
                                sm.token_to_req_indices, positions, window,
                                self._ratios[names[0]])
            if plan is not None:
                self.state_scratch_tokens += plan.transient
                for n in names:
                    self._plans[n] = plan

    def take_lost(self) -> set[int]:
        return super().take_lost() | {csa_lost_id(b) for b in self.csa.take_lost()}

    def stats(self, rank: int):
        base = super().stats(rank)
        c = self.csa.counters()
        counters = {f"v4_csa_{k}": c[k] for k in ("demotions", "promotions", "assigned",
                                                   "freed", "settle_overflows",
                                                   "failed_copies")}
        counters["v4_state_scratch_tokens"] = self.state_scratch_tokens
        delta = {k: v - self._csa_sent.get(k, 0) for k, v in counters.items()
                 if v != self._csa_sent.get(k, 0)}
        gauges = {"v4_csa_device_rows_used": c["device_used"],
                  "v4_csa_host_rows_used": c["host_used"]}
        if not delta and gauges == self._csa_sent.get("gauges"):
            return base
        self._csa_sent = {**counters, "gauges": gauges}
        data = dict(base.data) if base is not None else {}
        data.update(delta)
        data.update(per_rank_gauges(gauges, rank))
        return UlaStats(data=data)

    def usage(self) -> dict:
        out = super().usage()
        p = self.layout.csa
        out["csa"] = {"layers": len(p.layer_names), "row_bytes": p.row_bytes,
                      "device_rows": p.device_rows, "host_rows": p.host_rows,
                      "logical_blocks": p.num_blocks, "steps": self.csa.steps,
                      **self.csa.counters()}
        out["state_scratch_tokens"] = self.state_scratch_tokens
        # the scratch buffer's size (its largest step so far): memory outside the KV budget
        out["state_scratch_bytes"] = self._scratch.nbytes if self._scratch is not None else 0
        return out
