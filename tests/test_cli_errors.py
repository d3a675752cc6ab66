"""Exit codes and one-line errors for odd arguments, code that exits, warnings and argparse (issue 11, item 3).

Exit status: 0 healthy, 1 findings, 2 no verdict (one line on stderr; ``--debug`` adds the traceback and keeps 2),
130 a real Ctrl-C. The user's factory or module calling ``sys.exit(0)`` must never look like "healthy".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.cli.main import main


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "mlp.pt"
    torch.save(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).state_dict(), path)
    return path


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in a terminal: a shell starts background jobs with SIGINT ignored, where a
    Ctrl-C cannot reach the CLI and a KeyboardInterrupt cannot be told from one (these tests would then fail)."""
    if not hasattr(signal, "SIGINT"):
        yield
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture()
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package of factories written to tmp_path, importable from the current directory (as the CLI promises)."""
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "models.py").write_text(
        textwrap.dedent(
            """
            import sys
            from torch import nn

            def mlp():
                return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

            def exits_0():
                sys.exit(0)

            def raises_system_exit():
                raise SystemExit("bye")

            def raises_keyboard_interrupt():
                raise KeyboardInterrupt

            def real_ctrl_c():
                import os, signal
                os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends on Ctrl-C
                return mlp()

            def loss(output, batch):
                return output.float().pow(2).mean()

            def warns():
                import warnings
                warnings.warn("this factory is old. Use another one", UserWarning)
                return mlp()
            """
        )
    )
    (tmp_path / "userpkg" / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the cwd; undo it afterwards
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("ampdoctor: error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("ampdoctor: error: ")


def diagnose(ckpt: Path, *extra: str) -> list[str]:
    argv = ["diagnose", str(ckpt), *extra]
    if "--model" not in extra:
        argv += ["--model", "userpkg.models:mlp"]
    if not any(a.startswith(("--input-shape", "--batch")) for a in extra):
        argv += ["--input-shape", "2x4"]
    return argv


# -- the user's code exits or is interrupted ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("exits_0", "--model userpkg.models:exits_0: the factory called sys.exit(0); ampdoctor needs it to return"),
        (
            "raises_system_exit",
            "--model userpkg.models:raises_system_exit: the factory called sys.exit('bye'); ampdoctor needs it to "
            "return",
        ),
        (
            "raises_keyboard_interrupt",
            "--model userpkg.models:raises_keyboard_interrupt: the factory raised KeyboardInterrupt (no Ctrl-C was "
            "pressed)",
        ),
    ],
)
def test_a_factory_that_exits_is_exit_2_not_healthy(
    ckpt: Path, user_modules: Path, capsys: pytest.CaptureFixture[str], factory: str, expected: str
) -> None:
    # sys.exit(0) in the factory used to end ampdoctor with status 0, which means "healthy".
    assert main(diagnose(ckpt, "--model", f"userpkg.models:{factory}")) == 2
    assert error_line(capsys) == expected


@pytest.mark.parametrize("option", ["--model", "--loss"])
def test_a_module_that_exits_on_import_is_exit_2(
    ckpt: Path, user_modules: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    spec = "userpkg.exits_on_import:build"
    assert main(diagnose(ckpt, option, spec)) == 2
    assert error_line(capsys) == (
        f"{option} {spec}: importing userpkg.exits_on_import called sys.exit(0); ampdoctor needs it to return"
    )


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="needs POSIX signals")
def test_a_real_ctrl_c_is_130(ckpt: Path, user_modules: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(diagnose(ckpt, "--model", "userpkg.models:real_ctrl_c")) == 130
    assert capsys.readouterr().err == "ampdoctor: interrupted; nothing was written\n"


def test_the_loss_module_works_when_it_behaves(
    ckpt: Path, user_modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(diagnose(ckpt, "--loss", "userpkg.models:loss", "--format", "json")) == 0
    assert capsys.readouterr().err == ""


# -- numbers, shapes and dtypes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        (
            "99999999999999999999",  # used to be a TypeError traceback, exit 1
            "--input-shape 99999999999999999999: 1e+20 values is more than a random input can hold here (at most "
            "2**31); give a smaller shape, or save a real batch and pass --batch FILE",
        ),
        ("65536x65536", "--input-shape 65536x65536: 4.29e+09 values is more than a random input can hold here"),
        ("8x", "--input-shape '8x': write positive sizes joined by x, e.g. 8x3x224x224"),
        ("x8", "--input-shape 'x8': write positive sizes"),
        ("0x3", "--input-shape '0x3': write positive sizes"),
        ("-1x3", "--input-shape '-1x3': write positive sizes"),
        ("8×3", "--input-shape '8×3': write positive sizes"),
        ("1e3", "--input-shape '1e3': write positive sizes"),
        ("", "--input-shape '': write positive sizes"),
    ],
)
def test_odd_input_shapes_are_one_line(
    ckpt: Path, capsys: pytest.CaptureFixture[str], shape: str, expected: str
) -> None:
    assert main(diagnose(ckpt, "--model", "torch.nn:Linear", f"--input-shape={shape}")) == 2
    assert error_line(capsys).startswith(expected)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "complex64", "qint8", "float", "nonsense"])
def test_unsupported_input_dtypes_list_the_supported_ones(
    ckpt: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    # float8 used to give a NotImplementedError traceback (aminmax on Float8_e4m3fn).
    assert main(diagnose(ckpt, "--model", "torch.nn:Linear", "--input-dtype", dtype)) == 2
    assert error_line(capsys) == (
        f"--input-dtype {dtype!r} is not a real floating, integer or bool dtype ampdoctor draws inputs in; use one "
        "of: float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool"
    )


@pytest.mark.parametrize("scale", ["0", "-1", "nan", "inf"])
def test_a_bad_scale_is_one_line(ckpt: Path, capsys: pytest.CaptureFixture[str], scale: str) -> None:
    assert main(diagnose(ckpt, "--model", "torch.nn:Linear", "--scale", scale)) == 2
    assert error_line(capsys).startswith("--scale must be a positive number")


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--margin-bits", "99", "--margin-bits must be a number of bits from 0 to 8 (1 means 2x), got 99"),
    ("--margin-bits", "nan", "--margin-bits must be a number of bits from 0 to 8 (1 means 2x), got nan"),
    ("--verify-steps", "-1", "--verify-steps must be from 0 (off) to 10000, got -1"),
])
def test_an_out_of_range_number_is_refused_at_once_by_its_flag(
    ckpt: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, said: str
) -> None:
    # Refused before the model was built, by the flag's name (it took the model's build and named margin_bits).
    assert main(diagnose(ckpt, "--model", "no_such_module:factory", flag, value)) == 2
    assert error_line(capsys) == said


def test_allow_global_that_runs_code_is_refused(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(ckpt), "--allow-global", "posix.system"]) == 2
    assert error_line(capsys) == (
        "--allow-global posix.system: it can run code; ampdoctor never allows it (a checkpoint that needs it is "
        "likely malicious)"
    )
    assert main(["scan", str(ckpt), "--allow-global", "not a name"]) == 2
    assert "write it as module.name" in error_line(capsys)


# -- --debug, argparse, warnings, internal errors ----------------------------------------------------------------


def test_debug_keeps_the_exit_code_of_an_input_error(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--debug", *diagnose(ckpt, "--model", "torch.nn:Linear", "--input-shape", "8x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "InvalidInput" in err
    assert err.splitlines()[-1].startswith("ampdoctor: error: --input-shape '8x': write positive sizes")


@pytest.mark.parametrize(
    "argv",
    [
        ["scan"],
        ["scan", "--max-rows", "x", "ckpt.pt"],
        ["scan", "--dtype", "float64", "ckpt.pt"],
        ["scan", "ckpt.pt", "--no-such-option"],
        ["diagnose", "ckpt.pt"],
        ["diagnose", "ckpt.pt", "--model", "a:b", "--batch", "b.pt", "--input-shape", "2x4"],
        ["demo", "--format", "pdf"],
        ["no-such-command"],
        [],
    ],
)
def test_argparse_errors_are_at_most_two_lines(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2  # the usage errors used to print 5 to 9 lines
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 2, err
    assert lines[0].startswith("usage: ampdoctor") and "--help" in lines[0]
    assert "error: " in lines[1]


def test_library_warnings_go_to_the_notes_not_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A legacy file saved with pickle protocol 3: torch.load(weights_only=True) warns about the protocol (twice).
    path = tmp_path / "proto3.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False, pickle_protocol=3)
    assert main(["scan", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # 3 lines of torch's UserWarning used to reach stderr
    notes = out.split("\nNotes\n", 1)[1].split("\n\n", 1)[0]
    assert " ".join(notes.split()) == (  # once, though torch warned twice
        "- torch warned (UserWarning): Detected pickle protocol 3 in the checkpoint, which was not the default "
        "pickle protocol used by `torch.load` (2)"
    )


def test_a_protocol_4_pickle_is_named_not_called_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "proto4.pt"
    torch.save({"w": torch.ones(3)}, path, pickle_protocol=4)
    assert main(["scan", str(path)]) == 2
    assert error_line(capsys) == (
        f"{path}: saved with pickle protocol 4, which torch.load(weights_only=True) cannot read; save it again with "
        "torch.save's default protocol, or if you trust the file use --unsafe-load"
    )


def test_warnings_of_a_diagnosis_go_to_the_run_notes(
    ckpt: Path, user_modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ampdoctor.report import Report

    assert main(diagnose(ckpt, "--model", "userpkg.models:warns", "--format", "json")) == 0
    out, err = capsys.readouterr()
    assert err == ""
    notes = Report.from_json(out).run.notes
    assert "models warned (UserWarning): this factory is old" in notes


def test_an_internal_error_is_one_line_with_exit_2(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ampdoctor.checkpoint import scan as scan_module

    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("an ampdoctor bug")

    monkeypatch.setattr(scan_module, "analyse_scan", broken)
    assert main(["scan", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err == "ampdoctor: internal error: TypeError: an ampdoctor bug (rerun with --debug and report it)\n"


def test_the_program_ignores_ctrl_c_once_its_output_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C during the interpreter's teardown, after the report was written, made the run die by signal (the
    shell read 130, "nothing was written") or print a traceback and exit 0."""
    from ampdoctor.cli import main as cli_main

    monkeypatch.setattr(cli_main, "main", lambda: 1)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exited:
            cli_main.run()
        assert exited.value.code == 1
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("ampdoctor ")
