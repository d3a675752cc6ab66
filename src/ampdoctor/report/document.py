"""What a report says, in order, independent of the output format: the text and markdown renderers both lay
out this one document, so they say the same things. Pure: records in, a document out.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from ..analysis import Divergence, Origin
from ..records import BATCH, LOSS, OpFinding, Recommendation, SourceLocation, TensorStats
from .numbers import fmt_num

if TYPE_CHECKING:
    from .data import ReportData

# Names listed inline (propagation, not captured) before "...".
INLINE_NAMES = 8


def describe_bad(stats: TensorStats) -> str:
    """'3 NaN, 12 +inf of 4096 values' when counted; else what the survey saw."""
    if stats.detailed:
        parts = [
            f"{n} {label}"
            for n, label in ((stats.nan_count, "NaN"), (stats.posinf_count, "+inf"), (stats.neginf_count, "-inf"))
            if n
        ]
        return f"{', '.join(parts)} of {stats.numel} values"
    seen = ((stats.has_nan, "NaN"), (stats.has_posinf, "+inf"), (stats.has_neginf, "-inf"))
    flags = [label for flag, label in seen if flag]
    return "holds " + "/".join(flags)


# A backward op that passed on a non-finite value its forward saved (OpFinding.from_saved).
FROM_SAVED = (
    "no backward op made the value: this node read a non-finite value its forward saved and passed it on (a "
    "NaN/inf the forward made and discarded, as in the untaken branch of torch.where, still gets a gradient: "
    "0 x NaN = NaN): the cause is in the forward line above, not in this node"
)


def describe_op_head(op: OpFinding) -> str:
    inputs = ", ".join(f"{d} |x|max {fmt_num(a)}" for d, a in zip(op.input_dtypes, op.input_abs_max))
    text = f"op {op.op} ({inputs}) -> {op.output_dtype}"
    if op.node:
        text += f" in autograd node {op.node}"
    return text


def describe_where(op: OpFinding, loc: SourceLocation) -> str:
    """'at demo.py:32 in forward' (forward) or 'created in the forward at ...' (a backward node)."""
    where = "created in the forward at" if op.direction == "backward" else "at"
    return f"{where} {os.path.basename(loc.file)}:{loc.line} in {loc.function}"


def describe_origin(origin: Origin, origin_scale: float = 1.0) -> list[str]:
    """The origin's title line, then its details (each detail line starts with two spaces)."""
    title = "Forward origin" if origin.direction == "forward" else f"Backward origin (at scale {fmt_num(origin_scale)})"
    if origin.module == BATCH:
        return [f"{title}: the batch itself ({origin.tensor} {describe_bad(origin.bad)}); nothing in the model ran yet"]
    if origin.module == LOSS:
        output = (
            f"model output finite, |x|max {fmt_num(origin.input_abs_max)}"
            if origin.exact
            else "the model's output is of a type ampdoctor cannot inspect, so this is only where the non-finite "
            "value was first seen"
        )
        head = (
            f"{title}: the loss function ({output}; loss {describe_bad(origin.bad)})"
            if origin.direction == "forward"
            else f"{title}: outside the model: the gradient of the loss reaching the model is already non-finite"
        )
        lines = [head]
    else:
        exact = "" if origin.exact else " (approximate: no call matched the origin rule; first non-finite call)"
        lines = [f"{title}: {origin.label} ({origin.class_name}){exact}"]
        if origin.direction == "forward":
            received = f"inputs finite (|x|max {fmt_num(origin.input_abs_max)})"
        else:  # recorded unscaled; the op line below shows what the scaled backward held
            held = None if origin.input_abs_max is None else origin.input_abs_max * origin_scale
            received = (
                f"incoming gradient finite (|x|max {fmt_num(origin.input_abs_max)} unscaled, "
                f"{fmt_num(held)} as held at scale {fmt_num(origin_scale)})"
            )
        lines.append(f"  {received}; its own code made {origin.tensor} non-finite: {describe_bad(origin.bad)}")
    if origin.op is not None:
        lines.append("  " + describe_op_head(origin.op))
        if origin.op.location is not None:
            lines.append(f"    {describe_where(origin.op, origin.op.location)}: {origin.op.location.code}")
    if origin.op is not None and origin.op.from_saved:
        lines.append(f"  note: {FROM_SAVED}")
    if origin.op is not None and origin.op.discarded:
        lines.append(f"  note: also made and then discarded (not the cause): {discarded_text(origin.op)}")
    if origin.policy_note:
        lines.append(f"  note: {origin.policy_note}")
    return lines


def discarded_text(op: OpFinding) -> str:
    """The non-finite values the call made and discarded, one entry per op and line: 'aten::log at t5.py:88 (x2)'."""
    counts: dict[str, int] = {}
    for d in op.discarded:
        where = f" at {os.path.basename(d.location.file)}:{d.location.line}" if d.location is not None else ""
        key = f"{d.op}{where}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(key + (f" (x{n})" if n > 1 else "") for key, n in counts.items())


def cost_text(rec: Recommendation) -> Optional[str]:
    if rec.cost is None:
        return None
    cost = rec.cost
    return (
        f"+{cost.extra_activation_bytes / 1024:.1f} KiB of activations, "
        f"{cost.fp32_matmul_flop_share:.1%} of Linear/Conv FLOPs in float32"
        + (f" ({cost.note})" if cost.note else "")
    )


# -- the document ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Para:
    """A line of text; ``indent`` 1 is a section's body, 2 a detail under it."""

    text: str
    indent: int = 1


@dataclass(frozen=True)
class Source:
    """A source line (markdown shows it as code)."""

    text: str  # "at demo.py:32 in forward"
    code: str
    indent: int = 2


# Which rows a bounded table shows, unless it says otherwise (the hidden-overflow table: the first in op order).
RANKED = "most relevant"


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    left_out: int = 0  # rows past the bound (the k most relevant are shown; the JSON has all)
    shown_as: str = RANKED  # which rows a bounded table shows (left_out_line)


@dataclass(frozen=True)
class Item:
    """A numbered recommendation: title, status, details and a snippet to paste."""

    number: int
    title: str
    verified: bool
    details: tuple[str, ...]
    snippet: str


Block = Union[Para, Source, Table, Item]


@dataclass(frozen=True)
class Section:
    title: str
    blocks: tuple[Block, ...] = ()
    kind: str = ""  # "origin" for origin cards (a title that is itself a finding)


@dataclass(frozen=True)
class Document:
    verdict: str
    head: str  # "OVERFLOW - forward origin: blocks.1.attn"
    facts: str
    sections: tuple[Section, ...] = field(default_factory=tuple)
    alerts: tuple[str, ...] = ()  # facts that change what the report means, shown right under the head


def inline_names(labels: tuple[str, ...], limit: int = INLINE_NAMES) -> str:
    return ", ".join(labels[:limit]) + (" ..." if len(labels) > limit else "")


def origin_section(origin: Origin, scale: float) -> Section:
    lines = describe_origin(origin, scale)
    blocks: list[Block] = [Para(line.strip()) for line in lines[1:] if not line.startswith("    ")]
    if origin.op is not None and origin.op.location is not None:
        blocks.append(Source(describe_where(origin.op, origin.op.location), origin.op.location.code))
    return Section(lines[0], tuple(blocks), kind="origin")


def make_table(
    headers: tuple[str, ...], rows: list[list[object]], total: int = 0, shown_as: str = RANKED
) -> Table:
    """A table of ``rows``; ``total``: how many rows there were before a cut (the rest are said to be left out),
    ``shown_as``: which ones the rows are."""
    return Table(headers, tuple(tuple(str(v) for v in row) for row in rows), max(0, total - len(rows)), shown_as)


DIVERGENCE_TITLE = "Divergence (not harmless: GradScaler backing off does not stop it)"


def divergence_lines(d: Divergence) -> list[str]:
    """What a divergence finding says, one fact per line (every renderer and the watch's warning use these)."""
    lines = []
    if d.loss_median is not None and d.loss_peak is not None:
        times = d.loss_peak / d.loss_median if d.loss_median > 0 else math.inf
        rise = f"{times:.0f}x its median" if math.isfinite(times) else "non-finite"
        lines.append(
            f"the loss left its range at step {d.began} (recent median {fmt_num(d.loss_median)}; up to "
            f"{fmt_num(d.loss_peak)} at step {d.peak_step}: {rise})"
        )
    else:
        lines.append(f"weights or activations grew fast from step {d.began} while the loss rose")
    if d.growth:
        lines.append("fastest growth: " + ", ".join(
            f"{g.what} of {g.module or '<root>'} x{fmt_num(g.factor)} (steps {g.from_step}-{g.to_step})"
            for g in d.growth
        ))
    lines.append(f"then bad steps from step {d.skipped_from}")
    return lines


def verdict_text(report: ReportData) -> str:
    """'HEALTHY', or 'HEALTHY on random input' when the batch was random: never mistaken for real data's."""
    return report.verdict.upper() + (" on random input" if report.run.random_input else "")


def random_input_alert(random_input: str) -> str:
    """What a random batch means for the verdict (the first line under the head of every rendering)."""
    return (
        f"The batch was random ({random_input}), not your data: this verdict is about random values only. Real "
        "inputs (their scale, outliers, real targets) can overflow where random ones do not; give a real batch "
        "(--batch FILE, or --batch MODULE:FUNCTION) for a verdict on your data."
    )


def alerts(report: ReportData) -> tuple[str, ...]:
    """Facts that change what the whole report means: a random batch, the user's loop without AMP here, no
    gradient checked."""
    run = report.run
    random = [random_input_alert(run.random_input)] if run.random_input else []
    return (*random, *run.environment, *([run.backward_note] if run.backward_note else []))


def failed_passes(report: ReportData) -> list[str]:
    """One line per optional pass that failed or was skipped (would not fit in memory): what it was for, why."""
    missed = [p for p in report.run.passes if p.status != "ran"]
    return [f"{p.purpose} ({p.dtype}, scale {fmt_num(p.scale)}): {p.status}: {p.reason}" for p in missed]
