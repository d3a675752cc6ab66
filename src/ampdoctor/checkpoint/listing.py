"""Which files a scan reads, and which it could not: a scan never reports weights it did not see.

A directory is listed with ``stat`` before anything is opened (a FIFO named like a shard would block a reader;
``/dev/zero`` never ends). Every entry with a checkpoint suffix that is not a readable regular file is kept, with
the reason: a dangling symbolic link (an unfinished download in a Hugging Face cache), a FIFO, a device, no
permission. Index files (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) name the shards a
checkpoint is made of: a shard they name that is absent or unreadable is *missed* (the scan is incomplete). An
unreadable entry no index names is *missed* too when the directory has no index (it may be a shard); when an
index says which files the checkpoint is made of, an entry it does not name is only listed as skipped.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, InvalidInput
from ..report.inert import inert
from .sniff import file_kind, open_regular

# Files a directory scan opens (others, such as trainer_state.json, are left alone).
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
INDEX_SUFFIX = ".index.json"
# An index larger than this is not read (Hugging Face indexes of the largest models are a few MB).
MAX_INDEX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Unread:
    """An entry that could not be read, why, and whether it may hold weights the scan therefore did not see."""

    name: str
    reason: str
    missed: bool


@dataclass(frozen=True)
class Listing:
    """The files to read, the entries that could not be read, and the shards the directory's indexes name."""

    files: tuple[Path, ...]
    unread: tuple[Unread, ...] = ()
    indexed: frozenset[str] = frozenset()
    has_index: bool = False

    def missed(self, name: str) -> bool:
        """Whether a file of this listing that fails to load may hold weights the scan then did not see."""
        return name in self.indexed or not self.has_index


def _entry_problem(path: Path) -> str:
    """Why ``path`` cannot be read as a file ("" when it can), from ``stat`` alone (nothing is opened)."""
    raw = os.fsencode(path)
    try:
        mode = os.stat(raw).st_mode
    except FileNotFoundError:
        if os.path.islink(raw):
            return f"a dangling symbolic link (its target {inert(os.fsdecode(os.readlink(raw)))} is missing: an " \
                "unfinished download or copy?)"  # fmt: skip
        return "absent"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        target = f" (a link to {inert(os.fsdecode(os.readlink(raw)))})" if os.path.islink(raw) else ""
        return f"{file_kind(mode)}{target}, not a regular file: not read"
    if not os.access(raw, os.R_OK):
        return "cannot be read: permission denied"
    return ""


def _index_shards(path: Path) -> set[str]:
    """The shard file names an index's ``weight_map`` names. Raises CheckpointError for an unreadable index."""
    problem = _entry_problem(path)
    if problem:
        raise CheckpointError(problem)
    try:
        with open_regular(path) as fd, os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(MAX_INDEX_BYTES + 1)
        if len(data) > MAX_INDEX_BYTES:
            raise CheckpointError(f"larger than {MAX_INDEX_BYTES} bytes: not read")
        weight_map = json.loads(data.decode("utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"not a readable index ({type(exc).__name__}: {exc})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("not a readable index (no weight_map of file names)")
    return set(weight_map.values())


def list_checkpoint(path: Path) -> Listing:
    """The files a scan reads: the file itself, or every checkpoint entry of a directory, with those it cannot
    read. Raises InvalidInput for a missing path, a FIFO or device given as the path, CheckpointError for a
    directory with nothing to read."""
    raw = os.fsencode(path)
    if not os.path.lexists(raw):
        raise InvalidInput(f"{inert(str(path))}: no such file or directory")
    if os.path.isdir(raw):
        return _list_directory(path)
    problem = _entry_problem(path)
    if problem:
        raise InvalidInput(f"{inert(str(path))}: {problem}")
    return Listing((path,))


def _list_directory(root: Path) -> Listing:
    entries = sorted(os.listdir(os.fsencode(root)))
    names = [os.fsdecode(e) for e in entries]
    files: list[Path] = []
    unread: dict[str, Unread] = {}
    indexed: set[str] = set()
    has_index = False
    for name in names:
        if name.endswith(INDEX_SUFFIX):
            has_index = True
            try:
                indexed |= _index_shards(root / name)
            except CheckpointError as exc:  # the shards it names are unknown: nothing can say the scan is whole
                unread[name] = Unread(name, f"index file: {exc}", True)
    for name in names:
        if Path(name).suffix not in CHECKPOINT_SUFFIXES:
            continue
        problem = _entry_problem(root / name)
        if not problem:
            files.append(root / name)
        elif not os.path.isdir(os.fsencode(root / name)):
            unread[name] = Unread(name, problem, name in indexed or not has_index)
    present = set(names)
    for shard in sorted(indexed):
        if shard in unread:
            unread[shard] = Unread(shard, f"{unread[shard].reason} (an index names it)", True)
        elif shard not in present or os.sep in shard or shard in (".", ".."):
            unread[shard] = Unread(shard, "absent, although an index names it", True)
    if not files and not unread:
        raise CheckpointError(
            f"{inert(str(root))}: no checkpoint files in this directory (looked for {', '.join(CHECKPOINT_SUFFIXES)})"
        )
    return Listing(tuple(files), tuple(unread.values()), frozenset(indexed), has_index)
