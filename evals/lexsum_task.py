"""Multi-LexSum-style summarization for lm-eval: prompt, target and ROUGE scoring.

Used by the ``multi_lexsum`` task (the real allenai/multi_lexsum data, when ``datasets`` has
it offline: several long legal source documents per case, the "short" reference summary) and
by ``ulacache_lexsum`` (self-written fixtures of the same shape, ``fixtures/lexsum_cases.jsonl``).
``consistency.write_task`` copies this file beside the task yamls (lm-eval's ``!function``
imports from there).
"""
from __future__ import annotations

_SCORER = None


def doc_to_text(doc: dict) -> str:
    return "\n\n".join(doc["sources"]) + "\n\nSummarize the case in two sentences.\nSummary:"


def doc_to_target(doc: dict) -> str:
    # Multi-LexSum keys its summaries "summary/long", "summary/short", "summary/tiny".
    return doc.get("summary/short") or doc.get("summary/long") or doc.get("summary") or ""


def process_results(doc: dict, results: list) -> dict:
    """ROUGE-1 / ROUGE-2 / ROUGE-L F1 (Google's rouge_score, which lm-eval installs) of the
    generation against the reference."""
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = _SCORER.score(doc_to_target(doc), results[0].strip())
    return {k: v.fmeasure for k, v in scores.items()}
