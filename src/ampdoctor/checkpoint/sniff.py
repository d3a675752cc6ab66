"""What a file is, from its first bytes, and which globals its pickle names: without torch, without running it.

``sniff`` tells a PyTorch checkpoint (zip or legacy pickle) and a safetensors file from everything else, and says
what anything else looks like ("a text file", "a PNG image", "a zip archive without data.pkl"), so that a wrong
file gets a clear answer instead of an unpickler's ``KeyError: 101``. ``pickle_globals`` disassembles a pickle
(``pickletools``: nothing in it runs) to list the globals it would import.
"""

from __future__ import annotations

import _compat_pickle
import io
import json
import os
import pickletools
import stat
import struct
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, cast

FileKind = Literal["torch-zip", "torch-legacy", "safetensors", "broken-zip", "other"]

# The first pickle of a legacy (pre-1.6, or _use_new_zipfile_serialization=False) torch.save file holds this.
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# Most bytes of a pickle read to list its globals (a model's pickle is small; its storages are not in it).
_PICKLE_READ_LIMIT = 64 * 2**20
_HEAD = 4096
# Opening bytes of common files that are not checkpoints.
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "a gzip-compressed file (decompress it first)"),
    (b"BZh", "a bzip2-compressed file (decompress it first)"),
    (b"\xfd7zXZ\x00", "an xz-compressed file (decompress it first)"),
    (b"(\xb5/\xfd", "a zstd-compressed file (decompress it first)"),
    (b"\x93NUMPY", "a NumPy array file (.npy; diagnose takes it as --batch)"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras / h5py weights)"),
    (b"GGUF", "a GGUF model file (llama.cpp)"),
    (b"\x7fELF", "an executable program (ELF)"),
)
# Stands for a global whose module or name the pickle computes while loading: it cannot be checked beforehand.
COMPUTED_GLOBAL = "<a global whose name is computed while loading>"
# Opcodes that push a string (a STACK_GLOBAL takes its module and name from the last two).
_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
)


@dataclass(frozen=True)
class Sniffed:
    """What a file looks like. ``description`` says it in words for ``kind == "other"``."""

    kind: FileKind
    description: str = ""
    pickle_name: str = ""  # the zip member holding the pickle ("archive/data.pkl")


class NotARegularFile(OSError):
    """The path is a FIFO, a device, a socket or a directory: never opened for reading (a FIFO would block)."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


@contextmanager
def open_regular(path: Path) -> Iterator[int]:
    """A read-only descriptor of ``path``, opened without blocking (a FIFO would wait for a writer) and checked to
    be a regular file (the file type of what was opened, so a swap after a stat cannot fool it)."""
    fd = os.open(os.fsencode(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{file_kind(mode)}, not a regular file")
        yield fd
    finally:
        os.close(fd)


def _read_head(path: Path) -> bytes:
    with open_regular(path) as fd:
        return os.read(fd, _HEAD)


def name_is_utf8(path: Path) -> bool:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes kept as surrogates (os.fsdecode)
        return False
    return True


@contextmanager
def opened_for_torch(path: Path) -> Iterator[str]:
    """A name torch and safetensors can open ``path`` by (they take str names and encode them as UTF-8): the path
    itself, or for a file name that is not UTF-8, ``/proc/self/fd/N`` of a descriptor opened by its bytes."""
    if name_is_utf8(path):
        yield str(path)
        return
    if not os.path.isdir("/proc/self/fd"):
        raise UnicodeError(f"the file name {path!s} is not valid UTF-8 and this system has no /proc/self/fd")
    with open_regular(path) as fd:
        yield f"/proc/self/fd/{fd}"


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte little-endian header length, then a JSON object that fits in the file."""
    return len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < size


def _first_pickle_value(head: bytes) -> Optional[int]:
    """The integer a pickle at the start of ``head`` holds, if it holds only one (the legacy magic number)."""
    values = []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name in ("PROTO", "FRAME", "STOP"):
                continue
            values.append(arg)
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, OverflowError):
        return None
    return values[0] if len(values) == 1 and isinstance(values[0], int) else None


def _text_pickle(head: bytes) -> bool:
    """``head`` is a whole protocol 0 or 1 pickle (ASCII opcodes, no header: ``cposix\\nsystem\\n...``), which
    reads as text: it must be named a pickle, so that the globals it names are checked (and code refused)."""
    if not head or head[0] >= 0x80:
        return False
    ops = 0
    try:
        for op, _, _ in pickletools.genops(io.BytesIO(head)):
            ops += 1
            if op.name == "STOP":
                return ops > 1
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, OverflowError):
        return False
    return False


def _zip_kind(path: Path) -> Sniffed:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return Sniffed("broken-zip", "a damaged zip archive")
    pickles = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
    # torch.load(weights_only=False) hands any zip with a constants.pkl record to torch.jit.load (TorchScript
    # runs): such a file is never a checkpoint here, code/ folder or not.
    if any(n == "constants.pkl" or n.endswith("/constants.pkl") for n in names):
        return Sniffed("other", "a TorchScript archive (torch.jit.save); scan a state_dict saved with torch.save")
    if pickles:
        return Sniffed("torch-zip", pickle_name=pickles[0])
    if names and all(n.endswith(".npy") for n in names):
        return Sniffed("other", "a NumPy .npz archive (diagnose takes it as --batch)")
    return Sniffed("other", "a zip archive without data.pkl")


def _describe_other(head: bytes) -> str:
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if len(head) > 262 and head[257:262] == b"ustar":
        return "a tar archive (extract it first)"
    if (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5) or _text_pickle(head):
        return "a Python pickle without torch.save's header (not written by torch.save, or damaged)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the end of the head
            return "binary data of an unknown kind"
        text = head[: exc.start].decode("utf-8")
    if "\x00" in text or sum(c.isprintable() or c in "\n\r\t" for c in text) < 0.95 * max(len(text), 1):
        return "binary data of an unknown kind"
    stripped = text.lstrip()
    if stripped[:1] in ("{", "["):
        try:
            json.loads(text)
            return "a JSON document"
        except ValueError:
            return "a JSON document" if len(head) == _HEAD else "a text file"
    return "a text file" if stripped else "an empty text file"


def sniff(path: Path) -> Sniffed:
    """What ``path`` looks like: a PyTorch checkpoint (zip or legacy), a safetensors file, or something else."""
    head = _read_head(path)
    size = os.stat(os.fsencode(path)).st_size
    if not head:
        return Sniffed("other", "an empty file (0 bytes; the copy failed?)")
    if looks_like_safetensors(head, size):
        return Sniffed("safetensors")
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _zip_kind(path)
    if _first_pickle_value(head) == TORCH_LEGACY_MAGIC:
        return Sniffed("torch-legacy")
    return Sniffed("other", _describe_other(head))


# Pickles of a legacy torch.save file: magic number, protocol version, system info, the object, storage keys.
LEGACY_PICKLES = 5


def _pickle_data(path: Path, sniffed: Sniffed) -> tuple[io.BytesIO, bool]:
    """The bytes of the file's pickles (a zip's data.pkl; a legacy file from its start), up to the read limit,
    and whether the read was cut at the limit."""
    if sniffed.kind == "torch-zip":
        with zipfile.ZipFile(path) as zf, zf.open(sniffed.pickle_name) as member:
            data = member.read(_PICKLE_READ_LIMIT + 1)
    else:
        with open_regular(path) as fd, os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(_PICKLE_READ_LIMIT + 1)
    return io.BytesIO(data[:_PICKLE_READ_LIMIT]), len(data) > _PICKLE_READ_LIMIT


def _open_pickle(path: Path, sniffed: Sniffed) -> io.BytesIO:
    """The bytes of the file's object pickle (the legacy format's fourth pickle; a zip's data.pkl)."""
    data, _ = _pickle_data(path, sniffed)
    if sniffed.kind == "torch-legacy":
        for _ in range(3):  # magic number, protocol version, system info
            for _op in pickletools.genops(data):
                pass
    return data


def python3_name(module: str, name: str) -> tuple[str, str]:
    """Python 2 names of protocols 0-2 (``__builtin__.set``, ``copy_reg._reconstructor``) as the unpickler maps
    them."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _count(pickles: int) -> str:
    return "its first pickle" if pickles == 1 else f"its {pickles} pickles"


def pickle_globals(path: Path, sniffed: Sniffed) -> tuple[list[str], str]:
    """The globals (``module.name``) the file's pickles import (every pickle torch.load reads: a zip's
    data.pkl, the five pickles of a legacy file; for another pickle file, its first), and why the list may be
    incomplete ("" when it is complete: damaged, or larger than the read limit). Disassembled with
    ``pickletools``: nothing runs."""
    names: list[str] = []
    pickles = LEGACY_PICKLES if sniffed.kind == "torch-legacy" else 1
    cut = False
    try:
        data, cut = _pickle_data(path, sniffed)
        for _ in range(pickles):
            _globals_of_one(data, names)
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, OverflowError, KeyError) as exc:
        if cut:
            why = f"{_count(pickles)} go past the {_PICKLE_READ_LIMIT}-byte read limit"
        else:
            why = f"its pickle is damaged ({type(exc).__name__}: {exc})"
        return list(dict.fromkeys(names)), why
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, NotImplementedError) as exc:
        return list(dict.fromkeys(names)), f"its zip archive is damaged ({type(exc).__name__}: {exc})"
    return list(dict.fromkeys(names)), ""


def _globals_of_one(data: io.BytesIO, names: list[str]) -> None:
    """Add the globals of the pickle that starts at ``data``'s position (left after its STOP) to ``names``."""
    recent: list[Optional[str]] = []  # what the last two pushes were (a string, or None for anything else)
    memo: dict[int, Optional[str]] = {}
    for op, raw, _ in pickletools.genops(data):
        kind, arg = op.name, cast(Any, raw)
        if kind in ("GLOBAL", "INST"):
            module, _, name = str(arg).partition(" ")
            module, name = python3_name(module, name)
            names.append(f"{module}.{name}")
            recent.append(None)
        elif kind == "STACK_GLOBAL":
            if len(recent) == 2 and recent[0] is not None and recent[1] is not None:
                names.append(f"{recent[0]}.{recent[1]}")
            else:  # a name built at load time (str(...) of something): nothing can check it in advance
                names.append(COMPUTED_GLOBAL)
            recent = [None]
        elif kind in ("EXT1", "EXT2", "EXT4"):  # a global from copyreg's extension registry: unknowable here
            names.append(COMPUTED_GLOBAL)
            recent.append(None)
        elif kind in _STRING_OPS:
            recent.append(arg if isinstance(arg, str) else bytes(arg).decode("latin-1"))
        elif kind in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
            memo[len(memo) if kind == "MEMOIZE" else int(arg)] = recent[-1] if recent else None
        elif kind in ("BINGET", "LONG_BINGET", "GET"):
            recent.append(memo.get(int(arg)))
        elif kind not in ("PROTO", "FRAME"):
            recent.append(None)
        recent = recent[-2:]


def pickle_protocol(path: Path, sniffed: Sniffed) -> Optional[int]:
    """The protocol of the file's object pickle (its PROTO opcode), when it has one and it can be read."""
    if sniffed.kind == "other":
        return None
    try:
        for op, arg, _ in pickletools.genops(_open_pickle(path, sniffed)):
            return int(cast(int, arg)) if op.name == "PROTO" else None
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, OverflowError, zipfile.BadZipFile, OSError):
        return None
    return None


def may_be_bundle(path: Path, marker: str) -> bool:
    """False when ``path`` cannot be an ampdoctor failure bundle: a torch zip whose pickle holds ``marker``.

    Torch-free and cheap (the pickle only), so the command line can check its arguments before importing torch.
    """
    if not path.is_file():
        return False
    try:
        sniffed = sniff(path)
        if sniffed.kind != "torch-zip":
            return False
        return marker.encode() in _open_pickle(path, sniffed).getvalue()
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, NotImplementedError):
        return False
