"""Capacity planner: concurrent requests of one length that a cluster holds under stock vLLM,
HiSparse and ulacache (`python -m ulacache_vllm.planner`).

Invariant: ulacache figures come from the engine's own `engine.sizing.plan_layout`, stock and
HiSparse figures from vLLM's own sizing functions; nothing here re-derives them. vLLM is
imported only when a plan is computed. DeepSeek-V4 (``v4.py``): stock against ulacache's planned
V4 line in plain arithmetic (no engine sizing for it exists yet), checked against vLLM's own
grouping and the engine's ``plan_arena`` unless ``check_vllm=False``.
"""
from .capacity import Cluster, Plan, Row, make_cluster, plan
from .model import ModelShape, PlannerError, load_model

__all__ = ["Cluster", "ModelShape", "Plan", "PlannerError", "Row", "load_model",
           "make_cluster", "plan"]
