"""``diagnose``: the orchestration of passes on the user's model, and nothing else.

A survey pass first (mandatory: if it fails, the error is the answer); then only what the survey calls for, each
pass optional: scale probes, an underflow reference, the loss-scale window, a detailed re-run with the op zoom,
verification re-runs. Probes at other loss scales are backwards on the survey's own graph (no new forward). An
optional pass that raises (out of memory included) is recorded in ``report.run.passes``, and one whose estimated
peak would not fit the memory limit is skipped before it runs; the rest of the report stands on the passes that
ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
from torch import nn

from ._version import __version__
from .analysis import Findings, ScaleFinding, ScaleWindow, UnderflowFinding, analyze, forward_origin, near_limit
from .analysis.policy_check import checked_policy_notes
from .analysis.reproduced import unreproduced
from .analysis.scale import Histograms, Runner, measure_window, probe_scales, underflow_reference
from .analysis.survey_only import deferred_window_note, settle_from_survey
from .autocast_ops import autocast_note
from .capture.checks import (
    backward_note,
    check_autocast_effect,
    check_batch,
    check_device,
    check_model,
    resolve_scale,
    usable_batch,
)
from .capture.cleanup import owns_cleanup, pause_gc
from .capture.dtypes import autocast_dtype, dtype_name, model_device_type
from .capture.emulate import should_emulate_cuda
from .capture.memory import available_bytes, describe, pass_estimate
from .capture.model import eager_calls, unwrap_model
from .capture.options import DiagnoseOptions, LossFn, PassOptions, ProgressOption
from .capture.passes import PassSpec, capture_params
from .capture.session import Session, progress_callback
from .capture.sharded import full_model
from .capture.state import StateGuard
from .capture.stats import format_limits
from .fixes.overflows import sentinel_ops
from .fixes.recommend import recommend
from .fixes.steps import parameter_bytes, train_steps, with_steps
from .fixes.verify import VerifyContext, remedy_for, verify_recommendations
from .numbers import fmt_scale
from .records import BATCH, LOSS, ModuleInfo, PassTrace, Recommendation, RunInfo
from .report import Report
from .thresholds import MARGIN_BITS, UNDERFLOW_VERDICT_SHARE


@owns_cleanup
def diagnose(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Optional[LossFn] = None,
    dtype: torch.dtype = torch.float16,
    device_type: Optional[str] = None,
    scaler: Any = None,
    backward: bool = True,
    scale: Optional[float] = None,
    fp32_reference: bool = False,
    verify: bool = True,
    scale_window: Union[bool, str] = "auto",
    reference: Union[bool, int] = False,
    policy: Optional[str] = None,
    memory_limit: Union[None, int, str] = None,
    progress: ProgressOption = None,
    margin_bits: float = MARGIN_BITS,
    verify_steps: int = 0,
    optimizer: Optional[torch.optim.Optimizer] = None,
    underflow_reference: str = "auto",
) -> Report:
    """Run instrumented AMP steps on ``model`` and ``batch`` and say where and why they break.

    Args:
        model: the model as trained (DDP and ``torch.compile`` wrappers are peeled; the original runs eagerly).
        batch: a Tensor (``model(batch)``), a tuple/list (``model(*batch)``) or a dict (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar``. Without it: a scalar output, ``output.loss``, or a
            surrogate (the mean of the floating outputs), which the report names.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or a name: ``"fp16"``, ``"float16"``, ``"bf16"``, ...).
        device_type: autocast device type; default: the parameters' device.
        scaler: a ``GradScaler`` (``torch.amp`` or the deprecated ``torch.cuda.amp``); only ``get_scale()`` is
            read. Without it, float16 uses GradScaler's default 2**16 and bfloat16 is unscaled.
        backward: also run and analyse the scaled backward.
        scale: an explicit loss scale (overrides ``scaler``).
        fp32_reference: gradient values lost to underflow are counted against the backward at the largest
            finite scale of the low-precision format (a backward on the survey's graph: no new forward). Values
            too small for the format at every scale show only against a float32 backward: ``True`` runs the step
            once with autocast off for that (memory: the activations in float32), and uses it for the loss-scale
            window too.
        scale_window: the window of useful loss scales (largest without overflow, smallest losing < 1 % of
            gradient values): predicted from the gradients of one backward, both ends confirmed by re-runs
            (``True``). ``"auto"`` (default) takes the survey's own prediction without a re-run when it is
            confident (top by exact arithmetic on the largest recorded gradient, scale 1 predicted to lose under
            0.1 % of the parameter-gradient values and the low-precision gradients under 1 % of theirs; the report
            says "not re-run"), and leaves the window out when the forward makes inf/NaN that a
            later op hides (a hidden overflow: the step's gradients change with the remedy; a note says so).
            ``False``: no window.
        underflow_reference: ``"auto"`` (default) runs the reference backward that counts gradient values lost
            to underflow (at the largest finite scale) unless the survey's own gradients show it would find
            almost nothing: the parameter gradients computed in the low precision hold under 0.1 % zeros, and the
            binade histograms put under 0.1 % of values within 8 binades (or the distance to the largest finite
            scale, if more) above the format's flush threshold; the report's notes name that evidence.
            ``"always"`` runs it whenever a larger finite scale exists; ``"never"`` skips it (no underflow
            finding). See :mod:`ampdoctor.analysis.survey_only`.
        reference: compare each leaf call (``True``) or each call ``n`` levels down (an int) against a float32
            re-run of that call alone on its own inputs: relative error, SQNR, forward underflow. Never runs the
            whole model in float32.
        verify: prove each recommendation by re-running the step with it applied (float32 fallback of the
            origin, growing the set when a new origin appears; bfloat16; the safe loss scale).
        policy: whose autocast op policy the passes follow: ``"native"`` (torch.autocast on ``device_type``) or
            ``"cuda"`` (CUDA's op lists, emulated on CPU tensors: what CUDA would do, on a machine without a
            GPU). Default: native, except that ``device_type="cuda"`` on a machine without CUDA emulates.
        memory_limit: bytes a pass may add to what is in use when ``diagnose`` starts (an int >= 0, or text with a
            unit: ``"512MiB"``, ``"1.5GB"``; B, kB/KB, MB, GB, TB count in powers of 1000, KiB, MiB, GiB, TiB in
            powers of 1024); an optional pass whose peak, estimated from the survey, would exceed it is skipped
            (and listed). Default: the memory the device has available.
        progress: show one progress line on stderr naming each pass (``True``), never (``False``), use a
            :class:`ampdoctor.capture.progress.Progress`, or call ``progress(purpose, index, total)`` as each pass
            starts. Default: shown when stderr is a terminal, silent otherwise.
        margin_bits: a float32 fallback is *verified* only when, in the re-run with it, every instance of the fixed
            mechanism (same module class in the same place of a repeated structure) left in low precision keeps
            at least this many bits of headroom below the format's max (1 bit: 2x); otherwise the recommendation
            says it holds at this step, with so many bits to spare. Instances inside the margin join the fallback.
        verify_steps: train this many steps on the batch with the first verified float32 fallback or rewrite
            applied, on a copy of the model, under a new GradScaler, and add to its evidence whether it holds
            (loss finite at every step, no skipped step after the scaler's initial back-off). Memory: a copy of
            the parameters, their gradients and the optimizer's state (about 4x the parameters; stated in the
            report's notes and in the progress line), outside the passes' memory limit.
        optimizer: the training loop's optimizer, for ``verify_steps``: a new one of its type is built with its
            hyperparameters (``optimizer.defaults``) on the copy; never stepped itself. Default: AdamW(lr=1e-3).

    Every keyword is checked before anything runs: a value of the wrong type or range (``scale=True``,
    ``memory_limit=-1``, ``reference=-3``, ``loss_fn=3``, ``underflow_reference="sometimes"``) raises
    :class:`ampdoctor.InvalidInput` naming the keyword, the value and what it takes.

    Nothing the user owns changes (see the README's promises): parameters, buffers, ``.grad`` fields,
    ``training`` flags, RNG states and the scaler are as before, a backward the user built before the call still
    runs, and no hook stays behind. Each pass reads statistics back from the device once.
    """
    options = DiagnoseOptions(
        loss_fn=loss_fn, dtype=dtype, device_type=device_type, scaler=scaler, backward=backward, scale=scale,
        fp32_reference=fp32_reference, verify=verify, scale_window=scale_window, reference=reference,
        policy=policy, memory_limit=memory_limit, progress=progress, margin_bits=margin_bits,
        verify_steps=verify_steps, optimizer=optimizer, underflow_reference=underflow_reference,
    )
    check_batch(batch)
    root, notes = unwrap_model(model)
    # An FSDP2 model is diagnosed on its gathered full parameters (collective: every rank calls diagnose), and a
    # model.compile()d one eagerly: capture must see every call.
    with full_model(root) as root, eager_calls(root), _outside_user_autocast(), _without_cyclic_gc():
        return _diagnose_model(root, notes, batch, options)


@contextlib.contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the diagnosis (one pause shared by diagnoses in other threads: the
    caller's setting comes back with the last): full collections scanning its records only cost time."""
    resume = pause_gc()
    try:
        yield
    finally:
        resume()


@contextlib.contextmanager
def _outside_user_autocast() -> Iterator[None]:
    """Called inside the user's ``torch.autocast`` region, the passes must not inherit it (autocast applies to the
    loss scaling and backward ops too). Each pass opens its own region; the user's is back afterwards."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if autocast_dtype(device) is not None:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _diagnose_model(root: nn.Module, notes: list[str], batch: Any, options: DiagnoseOptions) -> Report:
    named, params = list(root.named_modules()), list(root.named_parameters())  # walked once per diagnosis
    check_model(root, named, params)
    device_type = options.device_type or model_device_type(root, batch)
    policy = options.policy
    emulate = policy == "cuda" or (policy is None and should_emulate_cuda(device_type))
    if not emulate:
        check_device(device_type)
    used_scale, scale_source, environment = resolve_scale(options.scaler, options.scale, options.dtype)
    limit = options.memory_bytes
    limit = available_bytes("cpu" if emulate else device_type) if limit is None else limit
    shown = progress_callback(options.progress)
    # Inside torch.inference_mode() autograd is off and tensors cannot be saved for backward: run with it off
    # (the context puts the user's mode back), on normal copies of inference tensors.
    with torch.inference_mode(False), shown as callback:
        spec = PassSpec(
            root=root,
            names={id(m): name for name, m in named},
            params=params,
            batch=usable_batch(batch),
            loss_fn=options.loss_fn,
            device_type="cpu" if emulate else device_type,
            dtype=options.dtype,
            backward=options.backward,
            policy="cuda_emulated" if emulate else "native",
            modules=[m for _, m in named],
        )
        guard = StateGuard(root, spec.params, modules=spec.modules)
        session = Session(spec, guard, limit, callback)
        try:
            report = _diagnose(session, named, used_scale, scale_source, options)
        finally:
            session.close()
            guard.restore()
    run = dataclasses.replace(
        report.run,
        notes=tuple(dict.fromkeys((*notes, *report.run.notes, *guard.notes))),
        environment=tuple(environment),
    )
    return dataclasses.replace(report, run=run)


def _diagnose(
    session: Session, named: list[tuple[str, nn.Module]], used_scale: float, scale_source: str, options: DiagnoseOptions
) -> Report:
    spec = session.spec
    fp32_reference = options.fp32_reference
    limits = format_limits(spec.dtype)
    # Parameters at the survey level (min, max, zeros); in detail only when a detailed re-run follows.
    modules = capture_params(spec, named, detailed=False)
    survey = _survey(session, used_scale, options.reference)
    check_autocast_effect(survey, limits.dtype, "cuda" if spec.policy == "cuda_emulated" else spec.device_type)
    origin = forward_origin(survey)
    def run(at_scale: float, autocast: bool, histograms: bool) -> tuple[PassTrace, Histograms]:
        # A probe that may be the top is the reference for predictions: every low-precision gradient's histogram.
        trace = session.run(at_scale, PassOptions(autocast=autocast, histograms=2 if histograms else 0))
        return trace, session.histograms

    runner = Runner(run, fp32_reference)
    runner.seed(survey, session.histograms)
    survey_histograms = session.histograms
    scale_finding: Optional[ScaleFinding] = None
    underflow: Optional[UnderflowFinding] = None
    window: Optional[ScaleWindow] = None
    pass_notes: list[str] = []
    reference_note = ""
    # A hidden overflow (an op made inf/NaN that a later op hid) makes the step's gradients those of a forward the
    # remedy changes: the window waits for the detailed re-run's classification (sentinels alone do not count).
    window_deferred = options.scale_window == "auto" and bool(survey.op_overflows)
    measure = lambda: measure_window(runner, survey, modules, limits)  # noqa: E731
    if origin is None and survey.backward_ran:
        if not survey.gradients_finite():
            scale_finding = session.optional(
                "scale probe", lambda: probe_scales(runner, survey, modules, limits), None
            )
        else:
            wanted = False if window_deferred else options.scale_window
            window, reference_note = settle_from_survey(
                survey, survey_histograms, modules, limits, options.underflow_reference, options.fp32_reference, wanted
            )
            if reference_note:
                pass_notes.append(reference_note)
            else:
                underflow = session.optional(
                    "underflow reference", lambda: underflow_reference(runner, survey, modules, limits), None
                )
        if (
            window is None
            and options.scale_window
            and not window_deferred
            and (survey.gradients_finite() or (scale_finding is not None and scale_finding.largest_finite_scale))
        ):
            window = session.optional("loss-scale window", measure, None)
    session.share.release()  # the probes' graph goes before any other pass runs
    final = survey
    detail_wanted = origin is not None or scale_finding is not None or (
        underflow is not None and underflow.share >= UNDERFLOW_VERDICT_SHARE
    )
    near = None if detail_wanted else near_limit(survey, modules, limits)  # analyze's too, without a re-run
    if detail_wanted or near or survey.op_overflows:  # op overflows: counted, classified, located by the re-run
        zoom = None
        if origin is not None and origin.module != BATCH:
            zoom = (LOSS, 0) if origin.module == LOSS else (origin.module, origin.call)
        at_scale = used_scale
        if scale_finding is not None and scale_finding.analysed_scale is not None:
            at_scale = scale_finding.analysed_scale
        detailed = PassOptions(detailed=True, zoom=zoom, backward_zoom=scale_finding is not None)
        detail = lambda: session.run(at_scale, detailed)  # noqa: E731
        # Without the detailed re-run the report stands on the survey (no op zoom, survey-level counts).
        final = session.optional("detail and op zoom", detail, survey)
        if note := unreproduced(survey, final, at_scale == used_scale):  # never a report on a step that changed
            final, pass_notes = survey, [*pass_notes, note]
        modules = capture_params(spec, named)
        near = None  # analyze's own, on the detailed pass and parameters
    if window_deferred and window is None and origin is None and survey.backward_ran and survey.gradients_finite():
        hidden = [o for o in final.op_overflows if o.count != 0]
        if hidden:
            pass_notes.append(deferred_window_note(hidden))
        else:  # sentinels only: the step is what it is, and its window counts
            window = session.optional("loss-scale window", measure, None)
            session.share.release()
    notes: list[str] = []
    if session.loss_sources[0] == "surrogate" and survey.backward_ran:
        notes.append(
            "no loss_fn given and the output has no loss: the backward used a surrogate loss (mean of the "
            "floating outputs); pass loss_fn= for the real gradients"
        )
    notes += [n for n in final.notes if n not in notes]
    notes += pass_notes
    notes += _cost_notes(session, survey, underflow, fp32_reference, scale_finding, bool(reference_note))
    emulated = spec.policy == "cuda_emulated"
    run_info = RunInfo(
        torch_version=torch.__version__,
        ampdoctor_version=__version__,
        device="cpu (CUDA autocast policy, emulated)" if emulated else _describe_device(spec.root, spec.device_type),
        device_type="cuda" if emulated else spec.device_type,
        limits=limits,
        scale=used_scale,
        scale_source=scale_source,
        loss_source=session.loss_sources[0],
        model_class=type(spec.root).__name__,
        autocast_note=autocast_note("cuda_emulated" if emulated else spec.device_type),
        policy=spec.policy,
        notes=tuple(notes),
        huggingface=hasattr(type(spec.root), "_keep_in_fp32_modules") and hasattr(spec.root, "config"),
        backward_checked=survey.backward_ran,
        backward_note=backward_note(survey, spec.backward, spec.params),
    )
    cpu_policy = spec.policy == "native" and spec.device_type == "cpu"
    findings = analyze(final, modules, limits, underflow, scale_finding, window, survey.comparisons, cpu_policy, near)
    if cpu_policy:
        findings = _check_policy_notes(session, findings, modules, final.scale)
    recommendations = recommend(findings, run_info, modules, options.margin_bits)
    if options.verify and recommendations:
        recommendations = _verify(
            session, runner, modules, survey, findings, recommendations, used_scale, scale_finding,
            options.margin_bits, final,
        )
    if options.verify_steps and recommendations:
        recommendations, note = _train_steps(session, options, findings, recommendations)
        run_info = dataclasses.replace(run_info, notes=(*run_info.notes, note))
    run_info = dataclasses.replace(run_info, passes=tuple(session.log))
    return Report(run_info, tuple(modules), final, findings, tuple(recommendations))


def _check_policy_notes(session: Session, findings: Findings, modules: list[ModuleInfo], at_scale: float) -> Findings:
    """Decide the CPU-policy notes of the origins from the same step re-run under CUDA's policy (emulated): one
    forward for a forward origin, a forward and backward for a backward origin whose op CUDA runs differently.
    When that pass cannot run, the notes stay as worded from the op's name ("diagnose with the CUDA policy")."""
    fwd, bwd = findings.forward_origin, findings.backward_origin
    if fwd is None and (bwd is None or not bwd.policy_note):
        return findings
    if fwd is not None and fwd.module == BATCH:
        return findings
    variant = dataclasses.replace(session.spec, policy="cuda_emulated", backward=fwd is None)
    check = lambda: session.run(at_scale, variant=variant)  # noqa: E731
    cuda = session.optional("CUDA-policy check", check, None)
    return findings if cuda is None else checked_policy_notes(findings, cuda, modules)


def _train_steps(
    session: Session, options: DiagnoseOptions, findings: Any, recommendations: list[Recommendation]
) -> tuple[list[Recommendation], str]:
    """``verify_steps``: train a copy with the first verified rewrite and the first verified float32 fallback (each
    on its own copy); each one's evidence says whether it holds."""
    spec = session.spec
    origin = findings.forward_origin or findings.backward_origin
    chosen: dict[str, int] = {}
    for i, r in enumerate(recommendations):
        if r.verified and r.action not in chosen and remedy_for(r, origin) is not None:
            chosen[r.action] = i
    memory = describe(4 * parameter_bytes(spec.root))
    if not chosen:
        return recommendations, f"verify_steps={options.verify_steps}: no verified float32 fallback or rewrite to train"
    out = list(recommendations)
    for i in chosen.values():
        remedy = remedy_for(out[i], origin)
        assert remedy is not None
        with session.stage(f"training {options.verify_steps} steps with recommendation {i + 1} (about {memory} extra)"):
            result = train_steps(
                spec.root, spec.batch, spec.loss_fn, spec.device_type, spec.dtype, options.verify_steps, remedy,
                options.optimizer,
            )
        out[i] = with_steps(out[i], result)
    numbers = ", ".join(str(i + 1) for i in chosen.values())
    note = (
        f"verify_steps={options.verify_steps}: trained a copy of the model with recommendation(s) {numbers} "
        f"(about {memory} extra for the copy, its gradients and the optimizer state; nothing of yours changed)"
    )
    return out, note


def _cost_notes(
    session: Session,
    survey: PassTrace,
    underflow: Optional[UnderflowFinding],
    fp32_reference: bool,
    scale_finding: Optional[ScaleFinding],
    reference_skipped: bool = False,
) -> list[str]:
    """What the report leaves out to stay within one step's memory and a few steps' time, and how to get it."""
    notes = []
    skipped = [p for p in session.log if p.status == "skipped"]
    if skipped:
        notes.append(
            f"{len(skipped)} optional pass(es) skipped to stay within the memory limit: "
            + "; ".join(f"{p.purpose} at scale {fmt_scale(p.scale)} ({p.reason})" for p in skipped[:3])
        )
    low = dtype_name(session.spec.dtype)
    if survey.backward_ran and not fp32_reference and (survey.gradients_finite() or scale_finding is not None):
        dropped = any(p.purpose == "underflow reference" and p.status != "ran" for p in session.log)
        what = (
            f"the used scale {fmt_scale(survey.scale)} is already the largest finite one, so no larger {low} scale "
            "could count gradient values lost to underflow there"
            if underflow is None and scale_finding is None and not dropped
            else f"gradient values lost to underflow are counted against the backward at the largest finite {low} "
            "scale"
        )
        if reference_skipped:  # the note naming the evidence says what was counted
            what = "gradient values lost to underflow were not counted by a reference backward"
        notes.append(
            f"{what}; values too small for {low} at every scale show only against a float32 backward: "
            f"fp32_reference=True adds one float32 step (about +{describe(pass_estimate(survey, 'float32'))} here)"
        )
    return notes


def _survey(session: Session, used_scale: float, reference: Union[bool, int]) -> PassTrace:
    """The first pass. With ``reference`` it also re-runs calls in float32; a module that cannot run in float32
    (a float16-only kernel) costs the comparisons, not the diagnosis."""
    plain = PassOptions(histograms=2)  # every low-precision gradient's too: what the survey alone can settle
    if reference is False:
        return session.run(used_scale, plain)
    with session.stage("survey with float32 references"):
        try:
            return session.run(used_scale, dataclasses.replace(plain, reference=reference))
        except Exception:
            pass  # in the log; the plain survey below is the diagnosis
    return session.run(used_scale, plain)


def _verify(
    session: Session,
    runner: Runner,
    modules: list[ModuleInfo],
    survey: PassTrace,
    findings: Any,
    recommendations: list[Recommendation],
    used_scale: float,
    scale_finding: Optional[ScaleFinding],
    margin_bits: float,
    final: Optional[PassTrace] = None,
) -> list[Recommendation]:
    check_scale = used_scale
    if findings.forward_origin is None and scale_finding is not None and scale_finding.analysed_scale:
        check_scale = scale_finding.analysed_scale
    bf16_ok = session.spec.dtype == torch.float16 and (
        session.spec.device_type != "cuda" or torch.cuda.is_bf16_supported()
    )

    def run(at_scale: float) -> PassTrace:
        with session.stage("verification"):
            return session.run(at_scale)

    def run_unchanged(at_scale: float) -> PassTrace:  # each (scale, autocast) pass runs once per diagnosis
        with session.stage("verification"):
            return runner(at_scale)

    def run_bf16(at_scale: float) -> PassTrace:
        with session.stage("verification in bfloat16"):
            return session.run(at_scale, dtype=torch.bfloat16)

    context = VerifyContext(
        root=session.spec.root,
        modules=modules,
        baseline=survey,
        low_dtype=dtype_name(session.spec.dtype),
        run=run,
        run_other_dtype=run_bf16 if bf16_ok else None,
        run_unchanged=run_unchanged,
        device_type="cuda" if session.spec.policy == "cuda_emulated" else session.spec.device_type,
        limits=format_limits(session.spec.dtype),
        margin_bits=margin_bits,
        sentinel_ops=sentinel_ops(survey, final) if final is not None else frozenset(),
    )
    return verify_recommendations(context, findings, recommendations, check_scale)


def _describe_device(root: nn.Module, device_type: str) -> str:
    param = next(root.parameters(), None)
    if device_type == "cuda" and param is not None and param.is_cuda:
        return f"cuda:{param.device.index} ({torch.cuda.get_device_name(param.device)})"
    return device_type
