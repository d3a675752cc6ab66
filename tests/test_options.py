"""The options records: every public keyword checked up front (issue 19 item 11), one definition of the watch's
parameters, and defaults that match the documented ones (issue 17 item 2)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.api import diagnose
from ampdoctor.capture.options import DiagnoseOptions, PassOptions
from ampdoctor.training.options import MAX_KEPT_OUTPUT_GRAD_BYTES, WatchOptions
from ampdoctor.training.runtime import Watch, watch

README = Path(__file__).resolve().parents[1] / "README.md"


def _hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )


def _assert_refused(exc: ampdoctor.InvalidInput, keyword: str, value: Any, expected: str) -> None:
    """The message names the keyword, shows the bad value and its type, and says what is expected."""
    text = str(exc)
    assert text.startswith(f"{keyword} must be "), text
    assert f"got {keyword}={value!r} ({type(value).__name__})" in text, text
    assert expected in text, text


BAD_DIAGNOSE = [
    ("scale", True, "positive finite number"),  # was taken as 1.0
    ("scale", 0, "positive finite number"),
    ("scale", -2.0, "positive finite number"),
    ("scale", float("inf"), "positive finite number"),
    ("scale", "1024", "positive finite number"),
    ("memory_limit", -1, "int >= 0"),  # was accepted: every optional pass skipped
    ("memory_limit", 1.5e9, "int >= 0"),
    ("memory_limit", True, "int >= 0"),
    ("memory_limit", "1 Gb", "MiB"),  # gigabit, or a typo: not a size
    ("memory_limit", "GB", "MiB"),
    ("memory_limit", "1.5", "MiB"),  # a unit is required in text
    ("memory_limit", "-1GB", "MiB"),
    ("reference", -3, "int >= 1"),  # was accepted silently
    ("reference", 0, "int >= 1"),
    ("reference", 1.5, "int >= 1"),
    ("reference", "leaves", "int >= 1"),
    ("progress", 3, "progress(purpose, index, total)"),  # was accepted silently
    ("progress", "yes", "progress(purpose, index, total)"),
    ("loss_fn", 3, "loss_fn(output, batch)"),  # said "the loss raised"
    ("dtype", torch.float32, "torch.float16 or torch.bfloat16"),
    ("dtype", "float8", "torch.float16 or torch.bfloat16 (or 'float16'"),
    ("dtype", "float32", "torch.float16 or torch.bfloat16 (or 'float16'"),
    ("backward", "yes", "True or False"),
    ("verify", None, "True or False"),
    ("fp32_reference", 1, "True or False"),
    ("scale_window", 0, "True or False"),
    ("scale_window", "always", '"auto", True or False'),
    ("underflow_reference", True, '"auto", "always" or "never"'),
    ("underflow_reference", "sometimes", '"auto", "always" or "never"'),
    ("policy", "CUDA", '"native", "cuda"'),
    ("device_type", 3, "device type"),
    ("device_type", "", "device type"),
    ("scaler", object(), "GradScaler"),
]


@pytest.mark.parametrize(("keyword", "value", "expected"), BAD_DIAGNOSE)
def test_a_bad_diagnose_keyword_is_refused_before_anything_runs(keyword: str, value: Any, expected: str) -> None:
    model = nn.Linear(2, 2)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))  # the user's own hook: the forward never ran
    with pytest.raises(ampdoctor.InvalidInput) as info:
        ampdoctor.diagnose(model, torch.ones(1, 2), **{keyword: value})
    _assert_refused(info.value, keyword, value, expected)
    assert calls == [] and _hooks(model) == 1


def test_the_options_record_is_frozen_and_holds_the_size_in_bytes() -> None:
    options = DiagnoseOptions(memory_limit="512MiB")
    assert options.memory_limit == options.memory_bytes == 512 * 2**20
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.verify = False  # type: ignore[misc]
    sizes = {"1GB": 10**9, " 2 KB ": 2000, "3kB": 3000, "1.5GiB": 3 * 2**29, "7B": 7, "1TiB": 2**40, "0MB": 0}
    assert {text: DiagnoseOptions(memory_limit=text).memory_bytes for text in sizes} == sizes
    assert DiagnoseOptions(memory_limit=0).memory_bytes == 0
    # Numbers that are not bool pass: numpy's and torch-free ints, 1 and 1.0 scales.
    assert DiagnoseOptions(scale=1).scale == 1 and DiagnoseOptions(reference=2).reference == 2


def test_the_dtype_may_be_named_as_people_write_it() -> None:
    names = {"float16": torch.float16, "FP16": torch.float16, "half": torch.float16, " bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}  # fmt: skip
    assert {name: DiagnoseOptions(dtype=name).dtype for name in names} == names
    assert {name: WatchOptions(dtype=name).dtype for name in names} == names
    assert WatchOptions(dtype=None).dtype is None
    boom = nn.Linear(16, 16, bias=False)
    nn.init.constant_(boom.weight, 5000.0)  # 16 * 5000 = 80000 > 65504: overflows in float16, not in bfloat16
    by_name = diagnose(nn.Sequential(boom), torch.ones(2, 16), dtype="bf16", progress=False)
    assert by_name.verdict == "healthy" and by_name.run.limits.dtype == "bfloat16"
    assert diagnose(nn.Sequential(boom), torch.ones(2, 16), dtype="fp16", progress=False).verdict == "overflow"


def test_a_size_in_text_limits_the_passes_like_the_same_number_of_bytes() -> None:
    def run(limit: Any) -> list[tuple[str, str]]:
        boom = nn.Linear(16, 16, bias=False)
        nn.init.constant_(boom.weight, 5000.0)  # 16 * 5000 = 80000 > 65504: overflows in float16
        report = diagnose(nn.Sequential(boom), torch.ones(2, 16), memory_limit=limit, progress=False)
        assert report.verdict == "overflow"
        return [(p.purpose, p.status) for p in report.run.passes]

    tiny = run("1B")
    assert tiny == run(1)
    assert tiny[0] == ("survey", "ran") and tiny[1:] and {status for _, status in tiny[1:]} == {"skipped"}
    assert {status for _, status in run("1GiB")} == {"ran"}


BAD_WATCH = [
    ("stats_every", -1, "int >= 0"),  # was clamped to 0 silently
    ("stats_every", 2.5, "int >= 0"),
    ("stats_every", True, "int >= 0"),
    ("history", 0, "int >= 1"),
    ("history", "all", "int >= 1"),
    ("max_captures", -1, "int >= 0"),
    ("bundle_dir", 3, "folder path"),
    ("save_bundle", "no", "True or False"),
    ("max_output_grad_bytes", -5, "int >= 0"),
    ("max_output_grad_bytes", "lots", "MiB"),
    ("loss_fn", 3, "loss_fn(output, batch)"),
    ("dtype", torch.float32, "torch.float16 or torch.bfloat16 (or 'float16', 'fp16', 'bfloat16', 'bf16'), or None"),
]


@pytest.mark.parametrize("make", [watch, Watch], ids=["watch", "Watch"])
@pytest.mark.parametrize(("keyword", "value", "expected"), BAD_WATCH)
def test_a_bad_watch_keyword_is_refused_before_any_hook(make: Any, keyword: str, value: Any, expected: str) -> None:
    model = nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu")
    scale_method = scaler.scale
    with pytest.raises(ampdoctor.InvalidInput) as info:
        make(model, scaler, **{keyword: value})
    _assert_refused(info.value, keyword, value, expected)
    assert _hooks(model) == 0 and scaler.scale == scale_method  # nothing installed, the scaler not tapped


def test_a_watched_scaler_must_be_a_grad_scaler() -> None:
    with pytest.raises(ampdoctor.InvalidInput) as info:
        watch(nn.Linear(2, 2), "scaler")  # type: ignore[arg-type]
    _assert_refused(info.value, "scaler", "scaler", "GradScaler (with scale() and update())")


def test_watch_options_in_text_and_bytes() -> None:
    assert WatchOptions(max_output_grad_bytes="64MiB").output_grad_bytes == 64 * 2**20
    with Watch(nn.Linear(2, 2), max_output_grad_bytes="1KiB", stats_every=0) as doctor:
        assert doctor.max_output_grad_bytes == 1024 and doctor.stats_every == 0
    assert doctor.options == WatchOptions(max_output_grad_bytes=1024, stats_every=0)


def _keywords(function: Any) -> dict[str, Any]:
    """Keyword-only parameters and their defaults, in order."""
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_watch_and_watch_class_share_one_definition_of_their_parameters() -> None:
    assert inspect.signature(watch).parameters == inspect.signature(Watch).parameters
    assert inspect.signature(watch).return_annotation == "Watch"
    fields = {f.name: f.default for f in dataclasses.fields(WatchOptions)}
    assert _keywords(Watch) == fields  # same names, same order, same defaults
    assert list(inspect.signature(Watch).parameters)[:2] == ["model", "scaler"]
    # A watch() call goes to Watch with the same keywords, and starts it.
    with watch(nn.Linear(2, 2), stats_every=3, history=5) as doctor:
        assert isinstance(doctor, Watch) and doctor.active
        assert doctor.options == WatchOptions(stats_every=3, history=5)
    assert not doctor.active


def test_diagnose_options_match_the_signature_and_the_readme() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(DiagnoseOptions)}
    assert _keywords(diagnose) == fields
    assert DiagnoseOptions() == DiagnoseOptions(**fields)
    # README's "What diagnose does" signature: the same keywords, in order, with the same defaults.
    block = re.search(r"ampdoctor\.diagnose\((model, batch, \*,.*?)\) -> Report", README.read_text(), re.S)
    assert block is not None
    tree = ast.parse(f"def diagnose({block.group(1)}): pass")
    args = tree.body[0].args  # type: ignore[attr-defined]
    documented = {
        a.arg: eval(ast.unparse(d), {"torch": torch}) for a, d in zip(args.kwonlyargs, args.kw_defaults)
    }
    assert documented == fields and list(documented) == list(fields)


def test_documented_watch_defaults() -> None:
    text = README.read_text()
    assert f"stats_every={WatchOptions().stats_every}" in text
    assert MAX_KEPT_OUTPUT_GRAD_BYTES == 256 * 2**20 and "256 MiB" in text and "256 MiB" in (watch.__doc__ or "")
    assert WatchOptions().history >= 1 and WatchOptions().max_captures >= 1


def test_pass_options_key_tells_reference_true_from_one() -> None:
    assert PassOptions(reference=True).forward_key() != PassOptions(reference=1).forward_key()
    assert PassOptions(histograms=2).forward_key() == PassOptions().forward_key()  # histograms: per backward
    assert PassOptions().survey_level and not PassOptions(detailed=True).survey_level
    assert not PassOptions(autocast=False).survey_level and not PassOptions(reference=True).survey_level
