"""Hostile pickles, written byte by byte (issue 19, items 1-3): no global the loading policy does not admit ever
runs, in any pickle torch.load reads (a zip's data.pkl; all five pickles of a legacy file; a plain pickle),
before or after padding past the pre-pass's read limit, with or without ``--unsafe-load``. Each payload would
create a sentinel file; the sentinel never exists, and each file is refused with one line naming the global.

The generator is seeded: every (format, position, payload) case is built, with the opcode style (GLOBAL,
STACK_GLOBAL, memoized module name, INST) drawn from a ``random.Random(SEED)``.
"""

from __future__ import annotations

import io
import json
import os
import pickletools
import random
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.checkpoint import sniff
from ampdoctor.checkpoint.load_weights import load_weights
from ampdoctor.checkpoint.scan import scan
from ampdoctor.cli.main import main
from ampdoctor.errors import AmpDoctorError, CheckpointRefused, InvalidInput

SEED = 19
pytestmark = pytest.mark.filterwarnings("ignore::ampdoctor.checkpoint.safe_load.UnsafeLoadWarning")
STYLES = ("GLOBAL", "STACK", "MEMO", "INST")


# -- a tiny pickle assembler -------------------------------------------------------------------------------------


def text(s: str) -> bytes:
    """BINUNICODE (read by the weights-only unpickler too)."""
    raw = s.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def short(s: str) -> bytes:
    """SHORT_BINUNICODE (protocol 4)."""
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def str_list(items: list[str]) -> bytes:
    return b"](" + b"".join(text(i) for i in items) + b"e"


def str_dict(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def call(module: str, name: str, args: bytes, style: str) -> bytes:
    """Push ``module.name(*args)``; ``args`` are pickled items (no MARK)."""
    if style == "GLOBAL":
        return b"c" + f"{module}\n{name}\n".encode() + b"(" + args + b"tR"
    if style == "STACK":
        return short(module) + short(name) + b"\x93(" + args + b"tR"
    if style == "MEMO":  # the module name is memoized, dropped, and fetched back: the pre-pass follows the memo
        return short(module) + b"r\xf0\x00\x00\x000" + b"j\xf0\x00\x00\x00" + short(name) + b"\x93(" + args + b"tR"
    assert style == "INST"
    return b"(" + args + b"i" + f"{module}\n{name}\n".encode()


@dataclass(frozen=True)
class Payload:
    name: str
    module: str
    attr: str

    def args(self, sentinel: Path) -> bytes:
        s = str(sentinel)
        if self.name in ("os.system", "posix.system"):
            return text(f"touch {s}")
        if self.name in ("builtins.exec", "builtins.eval", "torch.fx.graph_module._exec_with_source"):
            extra = b"}" if "fx" in self.name else b""
            return text(f"open({s!r}, 'w').close()") + extra
        if self.name == "subprocess.Popen":
            return str_list(["touch", s])
        if self.name == "logging.config.dictConfig":
            opens = [(text("()"), text("builtins.open")), (text("file"), text(s)), (text("mode"), text("w"))]
            handler = str_dict(opens)
            return str_dict([(text("version"), b"K\x01"), (text("handlers"), str_dict([(text("h"), handler)]))])
        if self.name == "torch.PyTorchFileWriter":  # creates the file it is given
            return text(s)
        if self.name == "numpy.memmap":  # numpy.memmap(path, "uint8", "w+", 0, (1,)) creates the file
            return text(s) + text("uint8") + text("w+") + b"K\x00" + b"K\x01\x85"
        return text(s)  # the unknown module: importing it is enough


PAYLOADS = [
    Payload("os.system", "os", "system"),
    Payload("posix.system", "posix", "system"),
    Payload("builtins.exec", "builtins", "exec"),
    Payload("builtins.eval", "builtins", "eval"),
    Payload("subprocess.Popen", "subprocess", "Popen"),
    Payload("logging.config.dictConfig", "logging.config", "dictConfig"),
    Payload("torch.fx.graph_module._exec_with_source", "torch.fx.graph_module", "_exec_with_source"),
    Payload("numpy.memmap", "numpy", "memmap"),
    Payload("torch.PyTorchFileWriter", "torch", "PyTorchFileWriter"),
    Payload("unknown", "ampdoctor_evil_module_19", "boom"),
]


@pytest.fixture
def evil_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on sys.path whose import alone creates the sentinel named in ``SENTINEL_FILE``."""
    where = tmp_path / "site"
    where.mkdir()
    (where / "ampdoctor_evil_module_19.py").write_text(
        "import os\nopen(os.environ['AMPDOCTOR_SENTINEL'], 'w').close()\ndef boom(p):\n    open(p, 'w').close()\n"
    )
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv("PYTHONPATH", f"{where}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sys.modules.pop("ampdoctor_evil_module_19", None)
    return where


# -- carriers: real torch.save files with a payload spliced into one pickle ---------------------------------------


def _zip_with(data_pkl: bytes) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in source.namelist():
            z.writestr(name, data_pkl if name.endswith("/data.pkl") else source.read(name))
    return out.getvalue()


def _real_data_pkl() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    return zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")


def zip_file(position: str, payload: bytes, pad: int = 0) -> bytes:
    """data.pkl is ``{"w": tensor}`` (``}q\\x00 ... s.``); the payload goes in as another item."""
    real = _real_data_pkl()
    assert real.startswith(b"\x80\x02}q\x00") and real.endswith(b"s.")
    item = text("x") + payload + b"s"
    if position == "first":
        return _zip_with(real[:5] + item + real[5:])
    if position == "last":
        return _zip_with(real[:-1] + item + b".")
    if position == "nested":
        return _zip_with(real[:-1] + text("deep") + b"}" + text("deeper") + b"}" + item + b"ss.")
    assert position == "padded"  # a large string first: the payload lies past the pre-pass's read limit
    padding = text("pad") + b"X" + pad.to_bytes(4, "little") + b"a" * pad + b"s"
    return _zip_with(real[:5] + padding + item + real[5:])


def zip_file_pickle(payload: bytes) -> bytes:
    real = _real_data_pkl()
    return real[:-1] + text("x") + payload + b"s."


def _legacy_pickles() -> tuple[list[bytes], bytes]:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    stream, pickles = io.BytesIO(data), []
    for _ in range(5):
        start = stream.tell()
        for _op in pickletools.genops(stream):
            pass
        pickles.append(data[start : stream.tell()])
    return pickles, data[stream.tell() :]


def legacy_file(index: int, payload: bytes) -> bytes:
    """Pickle ``index`` (0-4) becomes ``[<its own value>, payload]``."""
    pickles, storages = _legacy_pickles()
    body = pickles[index]
    if body.startswith(b"\x80"):
        body = body[2:]
    pickles[index] = b"\x80\x02](" + body[:-1] + payload + b"e."
    return b"".join(pickles) + storages


def plain_file(payload: bytes) -> bytes:
    return b"\x80\x02" + payload + b"."


POSITIONS = [
    *(("zip", p) for p in ("first", "last", "nested", "padded")),
    *(("legacy", str(i)) for i in range(5)),
    ("plain", "whole"),
]


def cases() -> Iterator[tuple[str, str, Payload, str]]:
    rng = random.Random(SEED)
    for fmt, position in POSITIONS:
        for payload in PAYLOADS:
            yield fmt, position, payload, rng.choice(STYLES)


def build(fmt: str, position: str, payload: Payload, style: str, sentinel: Path, pad: int) -> bytes:
    module = payload.module
    attr = payload.attr
    if payload.name == "unknown":
        module, attr = "ampdoctor_evil_module_19", "boom"
    ops = call(module, attr, payload.args(sentinel), style)
    if fmt == "zip":
        return zip_file(position, ops, pad)
    if fmt == "legacy":
        return legacy_file(int(position), ops)
    return plain_file(ops)


def test_the_generator_covers_every_style_position_and_payload() -> None:
    drawn = list(cases())
    assert {c[3] for c in drawn} == set(STYLES)
    assert len(drawn) == len(POSITIONS) * len(PAYLOADS) == 100


def test_no_payload_runs_anywhere_with_or_without_unsafe_load(
    tmp_path: Path, evil_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pad = 4096
    monkeypatch.setattr(sniff, "_PICKLE_READ_LIMIT", 1024)  # the padded position lies past it
    sentinel = tmp_path / "sentinel"
    monkeypatch.setenv("AMPDOCTOR_SENTINEL", str(sentinel))
    failures = []
    for i, (fmt, position, payload, style) in enumerate(cases()):
        path = tmp_path / f"case{i}.pt"
        path.write_bytes(build(fmt, position, payload, style, sentinel, pad))
        for unsafe in (False, True):
            try:
                scan(path, unsafe_load=unsafe)
                failures.append(f"{fmt}/{position}/{payload.name}/{style}/unsafe={unsafe}: loaded")
            except AmpDoctorError as exc:
                message = str(exc)
                if "\n" in message:
                    failures.append(f"{fmt}/{position}/{payload.name}: two lines: {message!r}")
            if sentinel.exists():
                failures.append(f"{fmt}/{position}/{payload.name}/{style}/unsafe={unsafe}: RAN")
                sentinel.unlink()
    time.sleep(0.2)  # a Popen that slipped through would have run by now
    assert not sentinel.exists()
    assert "ampdoctor_evil_module_19" not in sys.modules
    assert failures == []


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.name)
def test_unsafe_load_names_the_global_it_refused_past_the_read_limit(
    tmp_path: Path, evil_module: Path, monkeypatch: pytest.MonkeyPatch, payload: Payload
) -> None:
    # The pre-pass sees nothing (the payload lies past its read limit): the allow-list refuses it while loading.
    monkeypatch.setattr(sniff, "_PICKLE_READ_LIMIT", 1024)
    sentinel = tmp_path / "sentinel"
    monkeypatch.setenv("AMPDOCTOR_SENTINEL", str(sentinel))
    path = tmp_path / "padded.pt"
    path.write_bytes(build("zip", "padded", payload, "GLOBAL", sentinel, 4096))
    with pytest.raises(CheckpointRefused) as info:
        scan(path, unsafe_load=True)
    name = "ampdoctor_evil_module_19.boom" if payload.name == "unknown" else payload.name
    assert info.value.blocking == [name]
    assert str(info.value).startswith(f"{path}: refused by the --unsafe-load allow-list: it needs {name}; ")
    if payload.name == "unknown":
        assert "--trust ampdoctor_evil_module_19" in str(info.value)
    else:
        assert "can run code: this file is likely malicious; no flag admits it" in str(info.value)
    assert not sentinel.exists()


@pytest.mark.parametrize("index", [2, 4])
def test_os_system_in_a_hidden_legacy_pickle_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], index: int
) -> None:
    # Issue 19 item 1: the 3rd and 5th pickles were not checked; --unsafe-load ran os.system (HEALTHY, exit 0).
    sentinel = tmp_path / "sentinel"
    path = tmp_path / "legacy.pt"
    path.write_bytes(legacy_file(index, call("os", "system", text(f"touch {sentinel}"), "GLOBAL")))
    diagnose = ["diagnose", str(path), "--model", "torch.nn:Linear", "--model-kwargs", '{"in_features": 2, '
                '"out_features": 1}', "--input-shape", "2x2"]  # fmt: skip
    for argv in (["scan", str(path)], ["scan", str(path), "--unsafe-load"], diagnose, [*diagnose, "--unsafe-load"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (
            f"ampdoctor: error: {path}: refused by torch.load(weights_only=True): it needs os.system; "
            "os.system can run code: this file is likely malicious; do not allow it (ampdoctor refuses it even "
            "with --unsafe-load)"
        )
    assert not sentinel.exists()


def test_dictconfig_is_refused_as_code_not_called_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 19 item 3: without the flag this was "a corrupt checkpoint ... copy it again".
    sentinel = tmp_path / "sentinel"
    path = tmp_path / "logcfg.pt"
    payload = PAYLOADS[5]
    path.write_bytes(build("zip", "last", payload, "GLOBAL", sentinel, 0))
    assert main(["scan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "it needs logging.config.dictConfig; logging.config.dictConfig can run code" in err
    assert "corrupt" not in err and "copy it again" not in err
    assert not sentinel.exists()


@pytest.mark.slow
def test_a_payload_past_the_real_read_limit_is_refused(tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel"
    path = tmp_path / "big.pt"
    pad = sniff._PICKLE_READ_LIMIT + 4096
    path.write_bytes(build("zip", "padded", PAYLOADS[0], "GLOBAL", sentinel, pad))
    for unsafe in (False, True):
        with pytest.raises(CheckpointRefused, match="it needs os.system"):
            scan(path, unsafe_load=unsafe)
    assert not sentinel.exists()


# -- what the allow-list admits ----------------------------------------------------------------------------------


class Block(nn.Module):
    """A user's own module class (this test module plays the part of the --model / --trust package)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_unsafe_load_admits_torch_modules_optimizers_numpy_and_containers(tmp_path: Path) -> None:
    import argparse
    import collections

    import numpy as np

    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    opt = torch.optim.Adam(model.parameters())
    path = tmp_path / "whole.pt"
    torch.save(
        {
            "model": model,
            "opt": opt,
            "sched": torch.optim.lr_scheduler.StepLR(opt, 3),
            "rng": np.random.get_state(),
            "gen": np.random.default_rng(0),
            "args": argparse.Namespace(lr=1e-3),
            "counts": collections.defaultdict(list),
        },
        path,
    )
    report = scan(path, unsafe_load=True)
    assert report.verdict == "healthy"
    assert {t.name for t in report.tensors} >= {"model.0.weight", "model.1.bias"}


def test_a_user_class_needs_trust_and_trust_admits_exactly_its_package(tmp_path: Path) -> None:
    path = tmp_path / "block.pt"
    torch.save({"block": Block()}, path)
    with pytest.raises(CheckpointRefused) as info:
        scan(path, unsafe_load=True)
    assert info.value.blocking == [f"{__name__}.Block"]
    assert f"--trust {__name__.split('.')[0]}" in str(info.value)
    report = scan(path, unsafe_load=True, trust=[__name__])
    assert [t.name for t in report.tensors] == ["block.lin.weight", "block.lin.bias"]


def test_trust_does_not_reach_code_through_a_trusted_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # mypkg imports os: "mypkg.os.system" resolves to posix.system, which trust never admits.
    pkg = tmp_path / "site" / "ampdoctor_trusted_pkg_19"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sentinel = tmp_path / "sentinel"
    path = tmp_path / "t.pt"
    ops = call("ampdoctor_trusted_pkg_19", "os.system", text(f"touch {sentinel}"), "STACK")
    path.write_bytes(_zip_with(b"\x80\x04" + zip_file_pickle(ops)[2:]))  # protocol 4: dotted names are followed
    with pytest.raises(CheckpointRefused, match="refused by the --unsafe-load allow-list"):
        scan(path, unsafe_load=True, trust=["ampdoctor_trusted_pkg_19"])
    assert not sentinel.exists()


@pytest.mark.parametrize("name", ["os", "subprocess", "torch", "numpy.lib", "builtins", "logging", "__main__", "a b"])
def test_trust_refuses_packages_that_run_code(name: str) -> None:
    from ampdoctor.checkpoint.allow_list import check_trusted

    with pytest.raises(InvalidInput, match="--trust"):
        check_trusted(name)


def test_cli_trust_needs_unsafe_load_and_the_model_module_is_trusted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "block.pt"
    torch.save({"block": Block()}, path)
    assert main(["scan", str(path), "--trust", __name__]) == 2
    assert "--trust admits globals only when loading with --unsafe-load" in capsys.readouterr().err
    assert main(["scan", str(path), "--unsafe-load", "--trust", __name__, "--format", "json"]) == 0
    capsys.readouterr()
    torch.manual_seed(0)
    own = nn.Sequential(Block())
    whole = tmp_path / "whole.pt"
    torch.save(own, whole)
    model = nn.Sequential(Block())
    with pytest.raises(CheckpointRefused):
        load_weights(model, whole, unsafe_load=True)
    load_weights(model, whole, unsafe_load=True, trust=[__name__])
    assert torch.equal(model[0].lin.weight, own[0].lin.weight)


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch.fx.graph_module", "GraphModule"),  # compiles its graph's code when built
        ("torch.nn", "functional.relu"),  # a function of torch, not a class
        ("torch.serialization", "load"),
        ("numpy.lib.npyio", "NpzFile"),  # a Mapping that unpickles its members when read
        ("torch", "serialization.pickle.Unpickler"),  # a class of another module reached through torch
        ("torch", "PyTorchFileWriter"),  # a C++ binding whose home is "torch": writes a file when built
        ("torch", "ScriptModule"),
        ("torch", "_TorchCompileInductorWrapper"),
        ("torch.jit._script", "RecursiveScriptModule"),
    ],
)
def test_torch_and_numpy_names_outside_their_data_classes_are_refused(tmp_path: Path, module: str, name: str) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(_zip_with(b"\x80\x04" + zip_file_pickle(call(module, name, b"", "STACK"))[2:]))
    with pytest.raises(CheckpointRefused) as info:
        scan(path, unsafe_load=True)
    assert info.value.blocking == [f"{module}.{name}"]


def test_a_zip_with_constants_pkl_never_reaches_torch_jit_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.load(weights_only=False) dispatches any zip holding a constants.pkl record to torch.jit.load.
    calls = []
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: calls.append(a))
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "script.pt"
    with zipfile.ZipFile(path, "w") as z:
        for name in source.namelist():
            z.writestr(name, source.read(name))
        z.writestr("archive/constants.pkl", b"\x80\x02]q\x00.")
    for unsafe in (False, True):
        with pytest.raises(AmpDoctorError, match="TorchScript"):
            scan(path, unsafe_load=unsafe)
    assert calls == []


def test_trust_without_unsafe_load_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(InvalidInput, match="unsafe_load=True"):
        scan(path, trust=["mypkg"])
    with pytest.raises(InvalidInput, match="unsafe_load=True"):
        load_weights(nn.Linear(2, 1), path, trust=["mypkg"])


def make_blocks() -> nn.Sequential:
    """The --model factory of the test below (its module is trusted by --unsafe-load)."""
    return nn.Sequential(Block())


def test_diagnose_unsafe_load_admits_the_model_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    whole = tmp_path / "whole.pt"
    torch.save(make_blocks(), whole)  # a whole pickled model: its classes live in this test module
    argv = ["diagnose", str(whole), "--model", f"{__name__}:make_blocks", "--input-shape", "2x3", "--format", "json"]
    assert main(argv) == 2
    assert "refused by torch.load(weights_only=True)" in capsys.readouterr().err
    assert main([*argv, "--unsafe-load"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "healthy"
