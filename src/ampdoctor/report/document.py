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
from .hidden_rows import HIDDEN_HEADERS, hidden_note, hidden_rows, hidden_title
from .numbers import fmt_num
from .rows import ReportRows, bits_text

if TYPE_CHECKING:
    from .report import Report

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


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    left_out: int = 0  # rows past the bound (the k most relevant are shown; the JSON has all)


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


def _names(labels: tuple[str, ...], limit: int = INLINE_NAMES) -> str:
    return ", ".join(labels[:limit]) + (" ..." if len(labels) > limit else "")


def _origin_section(origin: Origin, scale: float) -> Section:
    lines = describe_origin(origin, scale)
    blocks: list[Block] = [Para(line.strip()) for line in lines[1:] if not line.startswith("    ")]
    if origin.op is not None and origin.op.location is not None:
        blocks.append(Source(describe_where(origin.op, origin.op.location), origin.op.location.code))
    return Section(lines[0], tuple(blocks), kind="origin")


def _table(headers: tuple[str, ...], rows: list[list[object]], total: int = 0) -> Table:
    return Table(headers, tuple(tuple(str(v) for v in row) for row in rows), max(0, total - len(rows)))


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


def build_document(report: Report, max_rows: int = 20) -> Document:
    """Everything the text and markdown reports say, in order."""
    f, run = report.findings, report.run
    origin = f.forward_origin or f.backward_origin
    head = verdict_text(report) + (f" - {origin.direction} origin: {origin.label}" if origin is not None else "")
    if not run.backward_checked:
        head += " (forward only: no gradient was checked)"
    if f.divergence is not None:
        head += f" - divergence from step {f.divergence.began}"
    backward = (
        f"loss scale {fmt_num(run.scale)} ({run.scale_source}), loss from {run.loss_source}"
        if run.backward_checked
        else "forward only"
    )
    facts = (
        f"{run.limits.dtype} autocast on {run.device}, {backward}, torch {run.torch_version}, "
        f"{len(report.trace.calls)} module calls"
    )
    sections: list[Section] = []
    if f.divergence is not None:
        said = [Para(line) for line in divergence_lines(f.divergence)]
        said += [Para(f"try: {advice}", 2) for advice in f.divergence.advice]
        sections.append(Section(DIVERGENCE_TITLE, tuple(said)))
    for origin_ in (f.forward_origin, f.backward_origin):
        if origin_ is not None:
            sections.append(_origin_section(origin_, report.trace.scale))
    if f.propagation:
        title = f"Propagation: {len(f.propagation)} other call(s) carry the bad values"
        sections.append(Section(title, (Para(_names(f.propagation)),)))
    if f.hidden:
        hidden_table = _table(HIDDEN_HEADERS, [list(r) for r in hidden_rows(f.hidden, max_rows)])
        sections.append(Section(hidden_title(f.hidden), (Para(hidden_note(f.hidden)), hidden_table)))
    if f.scale is not None:
        s = f.scale
        probes = ", ".join(f"{fmt_num(p.scale)}:{'ok' if p.gradients_finite else 'inf'}" for p in s.probes)
        body: list[Block] = [Para(f"gradients non-finite at scale {fmt_num(s.used_scale)}; re-run at {probes}")]
        if s.largest_finite_scale is None:
            body.append(Para("non-finite even at scale 1: a real defect, not a loss-scale problem"))
        else:
            share = s.lost_share_at_largest
            body.append(
                Para(
                    f"largest finite scale {fmt_num(s.largest_finite_scale)}; gradient values lost to zero there: "
                    + (f"{share:.2%}" if share is not None else "unknown")
                    + (" (harmless)" if s.harmless else "")
                )
            )
        sections.append(Section("Loss scale", tuple(body)))
    if f.window is not None:
        w = f.window
        if w.empty:
            first = f"empty: no power-of-two scale avoids overflow and keeps 99% of gradient values ({w.reference})"
        else:
            where = "inside" if w.contains_current else "OUTSIDE"
            first = (
                f"useful scales [{fmt_num(w.min_useful)}, {fmt_num(w.max_safe)}]; "
                f"current {fmt_num(w.current)} is {where} ({w.reference})"
            )
        probes = ", ".join(
            f"{fmt_num(p.scale)}:" + (f"{p.lost_share:.1%} lost" if p.lost_share is not None else "inf")
            for p in w.probes
        )
        sections.append(Section("Loss-scale window", (Para(first), Para(f"measured at {probes}"))))
    if f.precision is not None:
        prec = f.precision
        body = [Para(f"error jumps at {prec.jump}" if prec.jump else "no call stands out")]
        if prec.underflow_calls:
            body.append(Para(f"forward underflow (nonzero in float32, zero here) in: {_names(prec.underflow_calls)}"))
        rows: list[list[object]] = [
            [c.label, c.path, fmt_num(c.relative_error), fmt_num(c.sqnr_db), c.underflow_count, c.reference_nonzero]
            for c in sorted(prec.comparisons, key=lambda c: -c.relative_error)[:max_rows]
        ]
        body.append(_table(("call", "tensor", "rel. error", "SQNR dB", "underflowed", "fp32 nonzero"), rows,
                           len(prec.comparisons)))
        sections.append(Section("Against a float32 re-run of each call", tuple(body)))
    if f.underflow is not None:
        u = f.underflow
        body = [
            Para(
                f"{u.lost} of {u.reference_nonzero} nonzero gradient values ({u.share:.2%}) became zero; "
                f"reference: {u.reference}"
            )
        ]
        rows = [[s.module or "<root>", s.lost, s.reference_nonzero, f"{s.share:.1%}"] for s in u.spots[:max_rows]]
        if rows:
            body.append(_table(("module", "lost", "ref nonzero", "share"), rows, len(u.spots)))
        sections.append(Section("Gradient underflow", tuple(body)))
    if f.near_limit:
        rows = [[n.label, n.tensor, fmt_num(n.abs_max), f"{n.headroom_bits:.2f}"] for n in f.near_limit[:max_rows]]
        sections.append(
            Section(
                f"Near the {run.limits.dtype} max (< 1 bit of headroom)",
                (_table(("call", "tensor", "|x|max", "headroom bits"), rows, len(f.near_limit)),),
            )
        )
    if f.not_captured:
        title = (
            f"Gradient not observed for {len(f.not_captured)} call(s) (output unused by the loss, or not capturable)"
        )
        sections.append(Section(title, (Para(_names(f.not_captured, 10)),)))
    if f.warnings:
        sections.append(Section("Warnings", tuple(Para(w) for w in f.warnings)))
    items = []
    for i, rec in enumerate(report.recommendations, 1):
        details = [f"evidence: {rec.evidence}"] if rec.evidence else []
        cost = cost_text(rec)
        if cost is not None:
            details.append(f"cost: {cost}")
        items.append(Item(i, rec.title, rec.verified, tuple(details), rec.snippet))
    if items:
        sections.append(Section("Recommendations", tuple(items)))
    steps = _steps(report, max_rows)
    if steps:
        sections.append(Section("Training steps", tuple(steps)))
    if report.trace.calls:
        ranked = ReportRows.of(report).by_headroom()
        table = _table(
            ("call", "class", "tensor", "dtype", "|x|max", "headroom bits"),
            [
                [r.label, r.class_name, r.tensor, r.stats.dtype, fmt_num(r.stats.abs_max), bits_text(r.headroom_bits)]
                for r in ranked[:max_rows]
            ],
            len(ranked),
        )
        sections.append(Section("Layers by headroom", (table,)))
    notes = [n for n in (run.autocast_note, *run.notes) if n]
    if notes:
        sections.append(Section("Notes", tuple(Para(n) for n in notes)))
    failed = failed_passes(report)
    if failed:
        title = f"{len(failed)} optional pass(es) failed or skipped; the findings stand on the others"
        at = len(sections) - 1 if sections and sections[-1].title == "Notes" else len(sections)
        sections.insert(at, Section(title, tuple(Para(line) for line in failed)))
    return Document(f.verdict, head, facts, tuple(sections), alerts(report))


def verdict_text(report: Report) -> str:
    """'HEALTHY', or 'HEALTHY on random input' when the batch was random: never mistaken for real data's."""
    return report.verdict.upper() + (" on random input" if report.run.random_input else "")


def random_input_alert(random_input: str) -> str:
    """What a random batch means for the verdict (the first line under the head of every rendering)."""
    return (
        f"The batch was random ({random_input}), not your data: this verdict is about random values only. Real "
        "inputs (their scale, outliers, real targets) can overflow where random ones do not; give a real batch "
        "(--batch FILE, or --batch MODULE:FUNCTION) for a verdict on your data."
    )


def alerts(report: Report) -> tuple[str, ...]:
    """Facts that change what the whole report means: a random batch, the user's loop without AMP here, no
    gradient checked."""
    run = report.run
    random = [random_input_alert(run.random_input)] if run.random_input else []
    return (*random, *run.environment, *([run.backward_note] if run.backward_note else []))


def failed_passes(report: Report) -> list[str]:
    """One line per optional pass that failed or was skipped (would not fit in memory): what it was for, why."""
    missed = [p for p in report.run.passes if p.status != "ran"]
    return [f"{p.purpose} ({p.dtype}, scale {fmt_num(p.scale)}): {p.status}: {p.reason}" for p in missed]


def _steps(report: Report, max_rows: int) -> list[Block]:
    """For ``ampdoctor.watch`` reports: the scale history and every skipped step with its explanation."""
    steps = report.steps
    if not steps:
        return []
    skipped = [s for s in steps if s.skipped]
    scales = [steps[0].scale] + [s.scale for a, s in zip(steps, steps[1:]) if s.scale != a.scale]
    history = " -> ".join(f"{fmt_num(v)}" for v in scales[:12]) + (" ..." if len(scales) > 12 else "")
    body: list[Block] = [Para(f"{len(steps)} step(s) recorded, {len(skipped)} skipped; scale {history}")]
    rows: list[list[object]] = [
        [
            s.step,
            s.rank,
            f"{fmt_num(s.scale)}",
            s.run or "-",
            "finite" if s.forward_finite else "non-finite",
            s.forward_origin or "-",
            s.backward_origin or "-",
        ]
        for s in skipped[:max_rows]
    ]
    if rows:
        headers = ("skipped step", "rank", "scale", "run", "forward", "forward origin", "backward origin")
        body.append(_table(headers, rows, len(skipped)))
    return body
