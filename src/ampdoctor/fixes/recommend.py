"""Turn findings into recommendations (pure: no torch, no live model): the rules of ``fixes.rules`` that apply
in the diagnosis's situation, in their order."""

from __future__ import annotations

from typing import Optional

from ..analysis import Findings
from ..records import ModuleInfo, Recommendation, RunInfo
from ..thresholds import MARGIN_BITS
from .rules import RULES, Context, situation
from .snippets import fallback_snippet, scale_literal

__all__ = ["fallback_snippet", "recommend", "scale_literal"]


def recommend(
    findings: Findings, run: RunInfo, modules: Optional[list[ModuleInfo]] = None, margin_bits: float = MARGIN_BITS
) -> list[Recommendation]:
    """The remedies that apply to the findings, most direct first (unverified: ``verify`` re-runs them). A
    recommended loss scale keeps ``margin_bits`` below the largest finite one."""
    ctx = Context(findings, run, tuple(modules or ()), margin_bits)
    where = situation(ctx)
    proposals = (rule(ctx) for rule in RULES if rule.situation == where)
    return [rec for rec in proposals if rec is not None]
