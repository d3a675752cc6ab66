"""Safe loading of checkpoint files: the whole security policy of ampdoctor, reviewable in one sitting.

Loading is always ``torch.load(..., weights_only=True)``. A file that needs other globals is refused with those
globals named; the caller may allow exactly those (``allow_globals``) or, as a last resort, load without the
safety net (``unsafe_load``). Globals from modules that can run code are called out as likely malicious.
Safetensors files are memory-mapped and read one tensor at a time. Nothing here writes anything.
"""

from __future__ import annotations

import importlib
import re
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AmpDoctorError, CheckpointRefused

# Files a directory scan opens (others, such as trainer_state.json, are left alone).
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
# Modules whose globals can run code: a checkpoint that names them is likely hostile; the refusal says so.
_DANGEROUS_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "subprocess",
        "builtins",
        "__builtin__",
        "sys",
        "shutil",
        "socket",
        "runpy",
        "importlib",
        "pickle",
        "_pickle",
        "marshal",
        "code",
        "codeop",
        "ctypes",
        "pty",
        "webbrowser",
    }
)


def is_dangerous(name: str) -> bool:
    """A global from a module that can run code (``os.system``, ``builtins.eval`` ...)."""
    return name.split(".")[0] in _DANGEROUS_MODULES


def refusal(path: str, blocking: Sequence[str]) -> CheckpointRefused:
    """The error for a file ``torch.load(weights_only=True)`` refused, with the advice its globals call for."""
    blocking = list(blocking)
    names = ", ".join(blocking) if blocking else "(unknown)"
    hostile = [n for n in blocking if is_dangerous(n)]
    if hostile:
        advice = (
            f"{', '.join(hostile)} can run commands: this file is likely malicious; do not allow it and do not "
            "use --unsafe-load"
        )
    else:
        advice = (
            f"if you trust the file, allow exactly these with --allow-global {','.join(blocking)} "
            "(Python: allow_globals=[...]), or as a last resort --unsafe-load (runs any code the file holds)"
        )
    return CheckpointRefused(
        f"{path}: refused by torch.load(weights_only=True): it needs {names}; {advice}", path, blocking
    )


class UnsafeLoadWarning(UserWarning):
    """A checkpoint is being loaded with ``weights_only=False``: any code it holds runs."""


@dataclass
class LoadedFile:
    """The contents of one file, held only while that file is scanned."""

    obj: Any
    format: str
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


def _is_safetensors(path: Path) -> bool:
    """By suffix, or by content: an 8-byte little-endian header length, then a JSON object."""
    if path.suffix == ".safetensors":
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
        size = path.stat().st_size
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < size


def resolve_global(name: str) -> Any:
    """The object a ``module.attr`` global name refers to (imports the module: only for names the user gave)."""
    parts = name.split(".")
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
    raise AmpDoctorError(f"--allow-global {name}: no such global (write it as module.name, e.g. argparse.Namespace)")


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


_GLOBAL_PATTERNS = (
    re.compile(r"GLOBAL ([\w.]+)"),
    re.compile(r"but got <class '([\w.]+)'>"),
)


def _blocking_globals(path: Path, message: str) -> list[str]:
    """Globals that kept ``weights_only=True`` from loading; found without running anything in the file."""
    import torch

    names: list[str] = []
    getter = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if getter is not None and zipfile.is_zipfile(path):
        try:
            names = list(getter(str(path)))
        except Exception:  # a scan aid only; the error message below still names one
            names = []
    for pattern in _GLOBAL_PATTERNS:
        names += pattern.findall(message)
    return list(dict.fromkeys(names))


def first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _load_torch(path: Path, allow_globals: Sequence[str], unsafe_load: bool) -> LoadedFile:
    import pickle

    import torch

    locations: dict[int, str] = {}

    def record_location(storage: Any, location: str) -> Any:
        try:
            locations[storage.data_ptr()] = location
        except Exception:  # storages without a data pointer (meta) simply go unrecorded
            pass
        return storage  # left on the CPU: nothing is copied to a device

    if path.stat().st_size == 0:
        raise AmpDoctorError(f"{path}: the file is empty (0 bytes): not a checkpoint, or the copy failed")
    is_zip = zipfile.is_zipfile(path)
    if not is_zip:
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                raise AmpDoctorError(
                    f"{path}: a truncated or corrupt PyTorch zip checkpoint (no zip directory at its end); "
                    "copy it again, or use an earlier checkpoint"
                )
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
            raise AmpDoctorError(f"--allow-global needs torch >= 2.5 (this is {torch.__version__})")
        context = safe_globals(_allowed_objects(allow_globals))
    try:
        with context:
            obj = torch.load(str(path), map_location=record_location, mmap=is_zip, weights_only=not unsafe_load)
    except MemoryError:
        raise
    except Exception as exc:  # torch.load raises many types for a broken file; one message
        if not unsafe_load and isinstance(exc, pickle.UnpicklingError):
            blocking = [n for n in _blocking_globals(path, str(exc)) if n not in allow_globals]
            if blocking:
                raise refusal(str(path), blocking) from exc
        raise AmpDoctorError(
            f"{path}: not a readable PyTorch checkpoint (truncated, corrupt, or not a checkpoint): "
            f"{type(exc).__name__}: {_load_reason(str(exc))}"
        ) from exc
    return LoadedFile(obj, "torch" if is_zip else "torch-legacy", is_zip, locations)


def _load_reason(message: str) -> str:
    """The informative line of a torch.load error (the weights-only unpickler wraps it in boilerplate)."""
    marker = "WeightsUnpickler error:"
    if marker in message:
        after = message.split(marker, 1)[1]
        lines = [line.strip() for line in after.splitlines() if line.strip()]
        if lines:
            return lines[0]
    return first_line(message) or "no detail"


def load_file(path: Path, allow_globals: Sequence[str] = (), unsafe_load: bool = False) -> LoadedFile:
    """Read one checkpoint file (the only place file contents are read). Raises AmpDoctorError, never more."""
    if _is_safetensors(path):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise AmpDoctorError(
                f"{path}: reading .safetensors needs the safetensors package: pip install 'ampdoctor[safetensors]'"
            ) from None
        try:
            return LoadedFile(SafetensorsMapping(path), "safetensors", True, {})
        except Exception as exc:  # SafetensorError and friends: one clear line
            raise AmpDoctorError(
                f"{path}: not a readable safetensors file (truncated or corrupt): {first_line(str(exc))}"
            ) from exc
    return _load_torch(path, allow_globals, unsafe_load)


def checkpoint_files(path: Path) -> list[Path]:
    """The files a scan reads: the file itself, or the checkpoint files directly inside a directory."""
    if not path.exists():
        raise AmpDoctorError(f"{path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)
        if not files:
            raise AmpDoctorError(
                f"{path}: no checkpoint files in this directory (looked for {', '.join(CHECKPOINT_SUFFIXES)})"
            )
        return files
    if not path.is_file():
        raise AmpDoctorError(f"{path}: not a regular file or directory")
    return [path]

