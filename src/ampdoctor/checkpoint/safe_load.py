"""Safe loading of checkpoint files: the whole security policy of ampdoctor, reviewable in one sitting.

Loading is always ``torch.load(..., weights_only=True)``. Before that, the file's pickle is disassembled (nothing
runs) and a file that names a global able to run code (``os.system``, ``builtins.eval``, ``subprocess`` ...) is
refused as likely malicious, even with ``unsafe_load``. A file that needs other globals is refused with those
globals named: ``--allow-global`` is suggested only for the few known-harmless data types below (numpy arrays,
dtypes and RNG state, ``argparse.Namespace`` ...); for any other global ampdoctor says it cannot tell whether it
is safe. The caller may allow exactly the named globals (``allow_globals``) or, as a last resort, load without
the safety net (``unsafe_load``). Safetensors files are memory-mapped and read one tensor at a time. Nothing here
writes anything.
"""

from __future__ import annotations

import importlib
import pickle
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import CheckpointError, CheckpointRefused, InvalidInput
from .sniff import COMPUTED_GLOBAL, Sniffed, pickle_globals, pickle_protocol, sniff

# Files a directory scan opens (others, such as trainer_state.json, are left alone).
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")

GlobalKind = Literal["harmless", "code", "unknown", "corrupt"]
# Known-harmless data types that training checkpoints hold besides tensors: the only globals a refusal
# suggests allowing. Exact names (plus numpy's dtype classes, below).
HARMLESS_GLOBALS = frozenset(
    """
    argparse.Namespace collections.OrderedDict collections.defaultdict collections.Counter collections.deque
    torch.torch_version.TorchVersion _codecs.encode
    numpy.ndarray numpy.dtype numpy.core.multiarray._reconstruct numpy._core.multiarray._reconstruct
    numpy.core.multiarray.scalar numpy._core.multiarray.scalar
    numpy.random._pickle.__randomstate_ctor numpy.random._pickle.__generator_ctor
    numpy.random._pickle.__bit_generator_ctor numpy.random.mtrand.RandomState numpy.random._generator.Generator
    numpy.random._mt19937.MT19937 numpy.random._pcg64.PCG64 numpy.random._pcg64.PCG64DXSM
    numpy.random._philox.Philox numpy.random._sfc64.SFC64 numpy.random.bit_generator.SeedSequence
    numpy.random.bit_generator.__pyx_unpickle_SeedSequence
    builtins.set builtins.frozenset builtins.bytearray builtins.complex builtins.slice builtins.range
    builtins.list builtins.dict builtins.tuple builtins.int builtins.float builtins.str builtins.bytes builtins.bool
    datetime.datetime datetime.date datetime.time datetime.timedelta datetime.timezone
    """.split()
)
_HARMLESS_PATTERN = re.compile(r"numpy\.dtypes\.\w+DType")
# Modules whose globals can run code, and names elsewhere that load or run code: a file naming one is likely
# hostile. Checked after the harmless names (``builtins.set`` is harmless, ``builtins.eval`` is not).
_CODE_MODULES = frozenset(
    """
    os posix nt subprocess _posixsubprocess builtins __builtin__ sys shutil socket runpy importlib pickle _pickle
    marshal code codeop ctypes pty webbrowser multiprocessing operator functools types pdb bdb timeit trace
    cProfile profile commands popen2 platform asyncio threading _thread signal io _io tempfile glob pydoc
    zipimport imp pip setuptools distutils http urllib ftplib smtplib telnetlib xmlrpc gc inspect ensurepip venv
    """.split()
)
_CODE_NAMES = tuple(
    """
    torch.load torch.hub torch.jit torch.ops torch._C torch.serialization.load
    numpy.load numpy.lib.npyio numpy.testing numpy.f2py numpy.distutils
    """.split()
)
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
# Module names that mean "the script that ran" (classes defined there are pickled under them).
_SCRIPT_MODULES = ("__main__", "__mp_main__")


def classify_global(name: str) -> GlobalKind:
    """What a global a pickle names can do: a known-harmless data type, code execution, unknown, or no name at
    all (a corrupt file). Imports nothing: a module counts as present only when it is already imported."""
    if name == COMPUTED_GLOBAL:
        return "code"  # unknowable before it runs: treated as able to run code
    if not _NAME.fullmatch(name):
        return "corrupt"
    if name in HARMLESS_GLOBALS or _HARMLESS_PATTERN.fullmatch(name):
        return "harmless"
    if name.split(".")[0] in _CODE_MODULES or any(name == p or name.startswith(p + ".") for p in _CODE_NAMES):
        return "code"
    parts = name.split(".")
    if parts[0] in _SCRIPT_MODULES:
        return "unknown"  # the script that saved the file, not the one running now
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            obj: Any = module
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return "corrupt"  # a name the imported module does not have: damaged bytes, or another version
                obj = getattr(obj, attr)
            break
    return "unknown"


def _listing(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "(unknown)"


def refusal(path: str, blocking: Sequence[str]) -> CheckpointError:
    """The error for a file whose pickle needs ``blocking`` globals, with the advice their kinds call for.

    Code execution: likely malicious, never to be allowed. Unknown types: ampdoctor cannot tell whether they are
    safe. Names that do not exist: a corrupt file. Only known-harmless data types get the ``--allow-global``
    line to copy.
    """
    blocking = list(dict.fromkeys(blocking))
    kinds = {name: classify_global(name) for name in blocking}
    code = [n for n in blocking if kinds[n] == "code"]
    unknown = [n for n in blocking if kinds[n] == "unknown"]
    corrupt = [n for n in blocking if kinds[n] == "corrupt"]
    head = f"{path}: refused by torch.load(weights_only=True): it needs {_listing(blocking)}"
    if code:
        return CheckpointRefused(
            f"{head}; {_listing(code)} can run code: this file is likely malicious; do not allow it (ampdoctor "
            "refuses it even with --unsafe-load)",
            path,
            blocking,
        )
    if corrupt:
        return CheckpointError(
            f"{path}: a corrupt checkpoint (or one written by other versions of its libraries): its pickle names "
            f"{_listing(corrupt)}, which does not exist here; copy it again, or use an earlier checkpoint"
        )
    if unknown:
        return CheckpointRefused(
            f"{head}; ampdoctor does not know {_listing(unknown)} and cannot tell whether loading "
            f"{'it' if len(unknown) == 1 else 'them'} runs code; save the weights alone (e.g. model.state_dict()), "
            "or load the file yourself if you know what it holds",
            path,
            blocking,
        )
    return CheckpointRefused(
        f"{head}; these are harmless data types: if you trust the file, allow exactly these with --allow-global "
        f"{','.join(blocking)} (Python: allow_globals=[...])",
        path,
        blocking,
    )


def is_malicious(refused: CheckpointRefused) -> bool:
    """The refused file names a global that can run code."""
    return any(classify_global(name) == "code" for name in refused.blocking)


class UnsafeLoadWarning(UserWarning):
    """A checkpoint is being loaded with ``weights_only=False``: any code it holds runs."""


@dataclass
class LoadedFile:
    """The contents of one file, held only while that file is scanned."""

    obj: Any
    format: Literal["torch", "torch-legacy", "safetensors"]
    memory_mapped: bool
    locations: dict[int, str]  # storage data pointer -> location written in the file


class SafetensorsMapping(Mapping[str, Any]):
    """A safetensors file as a read-only mapping; each tensor is read when asked for (the file is mmapped)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._handle = safe_open(str(path), framework="pt", device="cpu")
        self._keys = list(self._handle.keys())
        self._key_set = set(self._keys)

    def __getitem__(self, key: str) -> Any:
        if key not in self._key_set:
            raise KeyError(key)
        return self._handle.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def check_global_name(name: str) -> str:
    """``--allow-global`` syntax (``module.name``), checked without importing anything; refuses code execution."""
    if not _NAME.fullmatch(name):
        raise InvalidInput(f"--allow-global {name!r}: write it as module.name, e.g. argparse.Namespace")
    if classify_global(name) == "code":
        raise InvalidInput(
            f"--allow-global {name}: it can run code; ampdoctor never allows it (a checkpoint that needs it is "
            "likely malicious)"
        )
    return name


def resolve_global(name: str) -> Any:
    """The object a ``module.attr`` global name refers to (imports the module: only for names the user gave)."""
    parts = check_global_name(name).split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise InvalidInput(f"--allow-global {name}: no such global (write it as module.name, e.g. argparse.Namespace)")


def _allowed_objects(names: Sequence[str]) -> list[Any]:
    objects = [resolve_global(n) for n in names]
    if "numpy.dtype" in names:
        # numpy >= 1.25 pickles dtype instances as their concrete class (numpy.dtypes.Float32DType, ...):
        # allowing numpy.dtype means allowing those too.
        import numpy

        dtypes = getattr(numpy, "dtypes", None)
        if dtypes is not None:
            objects += [cls for cls in vars(dtypes).values() if isinstance(cls, type) and issubclass(cls, numpy.dtype)]
    return objects


# The newest pickle protocol torch.load(weights_only=True) reads (4 adds FRAME opcodes it does not know).
_WEIGHTS_ONLY_PROTOCOL = 3
# Global names in torch's refusal message ("GLOBAL numpy.dtype was not an allowed global").
_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def _torch_allowed() -> set[str]:
    """Globals torch.load(weights_only=True) accepts by default (a private table; empty when it moved)."""
    import torch

    table = getattr(torch._weights_only_unpickler, "_get_allowed_globals", None)
    return set(table()) if callable(table) else set()


def first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _load_reason(exc: BaseException) -> str:
    """The informative line of a torch.load error (the weights-only unpickler wraps it in boilerplate)."""
    message = str(exc)
    if not message.strip() and isinstance(exc, EOFError):
        return "the file ends too early"
    marker = "WeightsUnpickler error:"
    if marker in message:
        after = message.split(marker, 1)[1]
        lines = [line.strip() for line in after.splitlines() if line.strip()]
        if lines:
            return lines[0]
    reason = first_line(message) or "no detail"
    return reason.split(". This is an internal miniz error", 1)[0]  # torch's zip reader adds a paragraph


def _load_torch(path: Path, sniffed: Sniffed, allow_globals: Sequence[str], unsafe_load: bool) -> LoadedFile:
    import torch

    needed, _ = pickle_globals(path, sniffed)  # a damaged pickle lists fewer: torch.load's check still runs
    allowed = _torch_allowed()
    foreign = [n for n in needed if n not in allowed]
    if any(classify_global(n) == "code" for n in foreign):
        raise refusal(str(path), foreign)  # before torch.load: nothing of the file runs, whatever the flags

    locations: dict[int, str] = {}

    def record_location(storage: Any, location: str) -> Any:
        try:
            locations[storage.data_ptr()] = location
        except (RuntimeError, NotImplementedError):  # meta storages have no data pointer: left unrecorded
            pass
        return storage  # left on the CPU: nothing is copied to a device

    is_zip = sniffed.kind == "torch-zip"
    context: AbstractContextManager[Any] = nullcontext()
    if unsafe_load:
        warnings.warn(
            f"loading {path} with torch.load(weights_only=False): any code the file holds runs",
            UnsafeLoadWarning,
            stacklevel=3,
        )
    elif allow_globals:
        safe_globals = getattr(torch.serialization, "safe_globals", None)
        if safe_globals is None:
            raise InvalidInput(f"--allow-global needs torch >= 2.5 (this is {torch.__version__})")
        context = safe_globals(_allowed_objects(allow_globals))
    try:
        with context:
            obj = torch.load(str(path), map_location=record_location, mmap=is_zip, weights_only=not unsafe_load)
    except MemoryError as exc:
        raise CheckpointError(
            f"{path}: not enough memory to read it ({path.stat().st_size} bytes on disk); a corrupt size field, "
            "or a checkpoint larger than this machine's memory"
        ) from exc
    except Exception as exc:  # torch.load raises many types for a damaged file: all become one line naming it
        if not unsafe_load and isinstance(exc, pickle.UnpicklingError):
            named = _GLOBAL_IN_MESSAGE.findall(str(exc))
            blocking = [n for n in dict.fromkeys([*named, *foreign]) if n not in allow_globals]
            if named and blocking:
                raise refusal(str(path), blocking) from exc
            protocol = pickle_protocol(path, sniffed)
            if protocol is not None and protocol > _WEIGHTS_ONLY_PROTOCOL and "Unsupported operand" in str(exc):
                raise CheckpointError(
                    f"{path}: saved with pickle protocol {protocol}, which torch.load(weights_only=True) cannot read; "
                    "save it again with torch.save's default protocol, or if you trust the file use --unsafe-load"
                ) from exc
        what = "PyTorch checkpoint" if is_zip else "PyTorch checkpoint (legacy format)"
        raise CheckpointError(
            f"{path}: a truncated or corrupt {what}: {type(exc).__name__}: {_load_reason(exc)}; copy it again, or "
            "use an earlier checkpoint"
        ) from exc
    return LoadedFile(obj, "torch" if is_zip else "torch-legacy", is_zip, locations)


def _load_safetensors(path: Path) -> LoadedFile:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError(
            f"{path}: reading .safetensors needs the safetensors package: pip install 'ampdoctor[safetensors]'"
        ) from None
    try:
        return LoadedFile(SafetensorsMapping(path), "safetensors", True, {})
    except Exception as exc:  # SafetensorError and friends: one clear line naming the file
        raise CheckpointError(
            f"{path}: not a readable safetensors file (truncated or corrupt): {first_line(str(exc))}"
        ) from exc


def load_file(path: Path, allow_globals: Sequence[str] = (), unsafe_load: bool = False) -> LoadedFile:
    """Read one checkpoint file (the only place file contents are read). Raises AmpDoctorError, never more."""
    try:
        sniffed = sniff(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    if sniffed.kind == "safetensors" or (
        path.suffix == ".safetensors" and sniffed.kind == "other" and sniffed.description.startswith("binary data")
    ):
        return _load_safetensors(path)
    if sniffed.kind == "broken-zip":
        raise CheckpointError(
            f"{path}: a truncated or corrupt PyTorch zip checkpoint (its zip directory is damaged); copy it again, "
            "or use an earlier checkpoint"
        )
    if sniffed.kind == "other":
        raise CheckpointError(f"{path}: not a checkpoint: {sniffed.description}")
    return _load_torch(path, sniffed, allow_globals, unsafe_load)


def checkpoint_files(path: Path) -> list[Path]:
    """The files a scan reads: the file itself, or the checkpoint files directly inside a directory."""
    if not path.exists():
        raise InvalidInput(f"{path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)
        if not files:
            raise CheckpointError(
                f"{path}: no checkpoint files in this directory (looked for {', '.join(CHECKPOINT_SUFFIXES)})"
            )
        return files
    if not path.is_file():
        raise InvalidInput(f"{path}: not a regular file or directory")
    return [path]
