"""Safe loading of checkpoint files: the whole security policy of ampdoctor, reviewable in one sitting (with
:mod:`.allow_list`, what ``--unsafe-load`` admits).

Loading is ``torch.load(..., weights_only=True)`` unless the caller asks for ``unsafe_load``. Before loading, the
file's pickles are disassembled (nothing runs; all five of a legacy file) and a file that names a global able to
run code (``os.system``, ``builtins.eval``, ``subprocess``, ``logging.config.dictConfig`` ...) is refused as
likely malicious. A file that needs other globals is refused with those globals named: ``--allow-global`` is
suggested only for the few known-harmless data types below (numpy arrays, dtypes and RNG state,
``argparse.Namespace`` ...); for any other global ampdoctor says it cannot tell whether it is safe. The caller may
allow exactly the named globals (``allow_globals``) or, as a last resort, load with ``unsafe_load``: then every
pickle torch reads is unpickled through the allow-list of :mod:`.allow_list`, which refuses, while loading,
every global it does not admit (the pre-pass only words the message; an incomplete pre-pass admits nothing).
Safetensors files are memory-mapped and read one tensor at a time. Nothing here writes anything.
"""

from __future__ import annotations

import importlib
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import CheckpointError, CheckpointRefused, InvalidInput
from ..report.inert import inert
from .allow_list import LoadPolicy, refused_global, restricted_pickle, trusted_roots
from .global_names import _NAME, _SCRIPT_MODULES, HARMLESS_GLOBALS, classify_global, is_harmless_name
from .listing import CHECKPOINT_SUFFIXES, list_checkpoint
from .sniff import Sniffed, name_is_utf8, opened_for_torch, pickle_globals, pickle_protocol, sniff

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "HARMLESS_GLOBALS",
    "UnsafeLoadWarning",
    "classify_global",
    "is_harmless_name",
    "load_file",
    "refusal",
]

def _listing(names: Sequence[str]) -> str:
    return ", ".join(inert(n) for n in names) if names else "(unknown)"


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
    head = f"{inert(path)}: refused by torch.load(weights_only=True): it needs {_listing(blocking)}"
    if code:
        return CheckpointRefused(
            f"{head}; {_listing(code)} can run code: this file is likely malicious; do not allow it (ampdoctor "
            "refuses it even with --unsafe-load)",
            path,
            blocking,
        )
    if corrupt:
        return CheckpointError(
            f"{inert(path)}: a corrupt checkpoint (or one written by other versions of its libraries): its pickle "
            f"names {_listing(corrupt)}, which does not exist here; copy it again, or use an earlier checkpoint"
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
        f"{','.join(inert(n) for n in blocking)} (Python: allow_globals=[...])",
        path,
        blocking,
    )


def is_malicious(refused: CheckpointRefused) -> bool:
    """The refused file names a global that can run code."""
    return any(classify_global(name) == "code" for name in refused.blocking)


def policy_refusal(path: str, name: str) -> CheckpointRefused:
    """The error for a global the ``--unsafe-load`` allow-list refused while loading, naming the flag that would
    admit it (none for code)."""
    kind = classify_global(name)
    head = f"{inert(path)}: refused by the --unsafe-load allow-list: it needs {inert(name)}"
    root = name.split(".")[0]
    if kind == "code":
        advice = f"{inert(name)} can run code: this file is likely malicious; no flag admits it"
    elif root in _SCRIPT_MODULES:
        advice = (
            "a class of the script that saved the file, which ampdoctor cannot import; save the weights alone "
            "(e.g. model.state_dict())"
        )
    elif root in ("torch", "numpy"):
        advice = (
            f"only {root}'s data classes are admitted; if you trust it, admit exactly it with --allow-global "
            f"{inert(name)}"
        )
    else:
        advice = (
            f"if you trust the package that defines it, admit it with --trust {inert(root)} (Python: "
            f"trust=[{root!r}]), or this name alone with --allow-global {inert(name)}"
        )
    return CheckpointRefused(f"{head}; {advice}", path, [name])


class NotACheckpoint(CheckpointError):
    """The file is something else (a text file, an image, a pickle torch.save did not write): nothing of it was
    loaded, and it holds no weights a scan could miss."""


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

        with opened_for_torch(path) as name:  # safe_open maps the file: the name is not needed afterwards
            self._handle = safe_open(name, framework="pt", device="cpu")
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


def _load_torch(path: Path, sniffed: Sniffed, allow_globals: Sequence[str], unsafe_load: bool, trust: Sequence[str]
                ) -> LoadedFile:  # fmt: skip
    import torch

    needed, _ = pickle_globals(path, sniffed)  # messages only: an incomplete list admits nothing (see below)
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
    extra: dict[str, Any] = {}
    if unsafe_load:
        # Every pickle torch reads goes through the allow-list: a global it does not admit is refused while
        # loading, before it is imported (the pre-pass above may have stopped early: damaged, or too large).
        extra["pickle_module"] = restricted_pickle(LoadPolicy(tuple(allow_globals), trusted_roots(trust)))
        warnings.warn(
            f"loading {inert(str(path))} with torch.load(weights_only=False) through ampdoctor's allow-list",
            UnsafeLoadWarning,
            stacklevel=3,
        )
    elif allow_globals:
        safe_globals = getattr(torch.serialization, "safe_globals", None)
        if safe_globals is None:
            raise InvalidInput(f"--allow-global needs torch >= 2.5 (this is {torch.__version__})")
        context = safe_globals(_allowed_objects(allow_globals))
    try:
        with context, opened_for_torch(path) as name:
            obj = torch.load(name, map_location=record_location, mmap=is_zip, weights_only=not unsafe_load, **extra)
    except MemoryError as exc:
        raise CheckpointError(
            f"{inert(str(path))}: not enough memory to read it ({path.stat().st_size} bytes on disk); a corrupt size "
            "field, or a checkpoint larger than this machine's memory"
        ) from exc
    except Exception as exc:  # torch.load raises many types for a damaged file: all become one line naming it
        if isinstance(exc, UnicodeError) and not name_is_utf8(path):
            raise name_problem(path, exc) from exc
        refused = refused_global(exc)
        if refused is not None:
            raise policy_refusal(str(path), refused) from None
        if not unsafe_load and isinstance(exc, pickle.UnpicklingError):
            named = _GLOBAL_IN_MESSAGE.findall(str(exc))
            blocking = [n for n in dict.fromkeys([*named, *foreign]) if n not in allow_globals]
            if named and blocking:
                raise refusal(str(path), blocking) from exc
            protocol = pickle_protocol(path, sniffed)
            if protocol is not None and protocol > _WEIGHTS_ONLY_PROTOCOL and "Unsupported operand" in str(exc):
                raise CheckpointError(
                    f"{inert(str(path))}: saved with pickle protocol {protocol}, which "
                    "torch.load(weights_only=True) cannot read; save it again with torch.save's default protocol, "
                    "or if you trust the file use --unsafe-load"
                ) from exc
        what = "PyTorch checkpoint" if is_zip else "PyTorch checkpoint (legacy format)"
        raise CheckpointError(
            f"{inert(str(path))}: a truncated or corrupt {what}: {type(exc).__name__}: {inert(_load_reason(exc))}; "
            "copy it again, or use an earlier checkpoint"
        ) from exc
    return LoadedFile(obj, "torch" if is_zip else "torch-legacy", is_zip, locations)


def _load_safetensors(path: Path) -> LoadedFile:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError(
            f"{inert(str(path))}: reading .safetensors needs the safetensors package: pip install "
            "'ampdoctor[safetensors]'"
        ) from None
    try:
        return LoadedFile(SafetensorsMapping(path), "safetensors", True, {})
    except Exception as exc:  # SafetensorError and friends: one clear line naming the file
        if isinstance(exc, UnicodeError) and not name_is_utf8(path):
            raise name_problem(path, exc) from exc
        raise CheckpointError(
            f"{inert(str(path))}: not a readable safetensors file (truncated or corrupt): {inert(first_line(str(exc)))}"
        ) from exc


def name_problem(path: Path, exc: BaseException) -> CheckpointError:
    """A file whose name (not its contents) could not be handed to the reader."""
    return CheckpointError(
        f"{inert(str(path))}: its file name is not valid UTF-8, and the reader could not open it by another name "
        f"({type(exc).__name__}); the file itself was not read: rename it (e.g. with only ASCII characters)"
    )


def _plain_pickle(path: Path, sniffed: Sniffed) -> CheckpointError:
    """A pickle torch.save did not write: never loaded; the globals it names are said (code ones refuse it)."""
    names, _ = pickle_globals(path, sniffed)
    if any(classify_global(n) == "code" for n in names):
        return refusal(str(path), names)
    named = f" (it names {inert(_listing(names))})" if names else ""
    return NotACheckpoint(f"{inert(str(path))}: not a checkpoint: {sniffed.description}{named}")


def load_file(
    path: Path, allow_globals: Sequence[str] = (), unsafe_load: bool = False, trust: Sequence[str] = ()
) -> LoadedFile:
    """Read one checkpoint file (the only place file contents are read). Raises AmpDoctorError, never more.
    ``trust``: packages (and the ``--model`` module) whose globals an unsafe load admits."""
    try:
        sniffed = sniff(path)
    except OSError as exc:
        raise CheckpointError(f"{inert(str(path))}: cannot read it: {exc.strerror or exc}") from exc
    if sniffed.kind == "safetensors" or (
        path.suffix == ".safetensors" and sniffed.kind == "other" and sniffed.description.startswith("binary data")
    ):
        return _load_safetensors(path)
    if sniffed.kind == "broken-zip":
        raise CheckpointError(
            f"{inert(str(path))}: a truncated or corrupt PyTorch zip checkpoint (its zip directory is damaged); copy "
            "it again, or use an earlier checkpoint"
        )
    if sniffed.kind == "other" and sniffed.description.startswith("a Python pickle"):
        raise _plain_pickle(path, sniffed)
    if sniffed.kind == "other":
        message = f"{inert(str(path))}: not a checkpoint: {sniffed.description}"
        if sniffed.description.startswith(_MAYBE_DAMAGED):
            # nothing recognisable: a failed copy or a damaged shard as likely as a stray file, so a directory
            # without an index counts it as weights the scan could not see (INCOMPLETE, never HEALTHY)
            raise CheckpointError(message)
        raise NotACheckpoint(message)
    return _load_torch(path, sniffed, allow_globals, unsafe_load, trust)


# What sniff says of a file it recognises nothing in: zero bytes, or bytes of no known kind.
_MAYBE_DAMAGED = ("an empty file", "binary data of an unknown kind")


def checkpoint_files(path: Path) -> list[Path]:
    """The files a scan reads: the file itself, or the readable checkpoint files directly inside a directory
    (:func:`~.listing.list_checkpoint` also says which entries could not be read)."""
    return list(list_checkpoint(path).files)
