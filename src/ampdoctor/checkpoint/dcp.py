"""``torch.distributed.checkpoint`` folders (FSDP2's format: ``.metadata`` plus ``*.distcp`` files), read without
a process group and without ``torch.distributed.checkpoint.load``: one tensor at a time.

The ``.metadata`` file is a pickle (protocol 4 or later, which torch's weights-only unpickler cannot read). It
is read by an allow-list unpickler that admits only the metadata classes of ``torch.distributed.checkpoint``
(dataclasses holding sizes, offsets and file positions), ``torch.Size``, torch dtypes and layouts, paths, and
the globals the user allowed (``--allow-global``); any other global stops the load before it runs, and is
refused through the loading policy's :func:`~.safe_load.refusal` (likely malicious, unknown, or
harmless-but-not-allowed). ``--unsafe-load`` never widens it. Every item of a ``.distcp`` file is a
``torch.save`` blob read with ``torch.load(weights_only=True)`` from a window onto the file, so nothing but the
item itself is read.

The checkpoint appears as :class:`DcpTree`, a read-only nested mapping rebuilt from the metadata's key paths
(``model`` -> ``0.weight``; ``optim`` -> ``state`` -> ``0`` -> ``exp_avg``). A tensor is read when its key is
asked for, and its chunks (one per rank that saved a shard of it) are assembled into one tensor: memory is
bounded by the largest tensor, not by the checkpoint.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ..errors import CheckpointError
from .safe_load import check_global_name, first_line, refusal, resolve_global

if TYPE_CHECKING:
    import torch

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def is_dcp_folder(path: Path) -> bool:
    """A folder holding ``.metadata`` and at least one ``*.distcp`` file."""
    return (
        path.is_dir()
        and (path / METADATA_FILE).is_file()
        and any(p.suffix == DATA_SUFFIX and p.is_file() for p in path.iterdir())
    )


# The globals a DCP ``.metadata`` pickle names, and all it may name (plus torch dtypes and the user's
# --allow-global names): plain data classes holding sizes, offsets, properties and file positions.
_METADATA_GLOBALS = frozenset(
    """
    torch.distributed.checkpoint.metadata.Metadata torch.distributed.checkpoint.metadata.TensorStorageMetadata
    torch.distributed.checkpoint.metadata.BytesStorageMetadata
    torch.distributed.checkpoint.metadata.ChunkStorageMetadata
    torch.distributed.checkpoint.metadata.TensorProperties torch.distributed.checkpoint.metadata.MetadataIndex
    torch.distributed.checkpoint.metadata.StorageMeta torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING
    torch.distributed.checkpoint.filesystem._StorageInfo torch.Size torch.serialization._get_layout
    pathlib.PosixPath pathlib.WindowsPath pathlib.PurePosixPath pathlib.PureWindowsPath pathlib.Path
    collections.OrderedDict
    """.split()
)


class _MetadataUnpickler(pickle.Unpickler):
    """An allow-list unpickler: a global outside the list stops the load before anything of it runs."""

    def __init__(self, data: bytes, allowed: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        import torch

        full = f"{module}.{name}"
        if full in self._allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(full)


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def read_metadata(folder: Path, allow_globals: Sequence[str] = ()) -> Any:
    """The folder's ``Metadata``, unpickled with an allow-list (see the module's docstring)."""
    path = folder / METADATA_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    allowed = _METADATA_GLOBALS | {check_global_name(n) for n in allow_globals}
    try:
        meta = _MetadataUnpickler(data, allowed).load()
    except _Refused as exc:
        raise refusal(str(path), [exc.name]) from None
    except Exception as exc:  # EOFError, UnpicklingError, struct errors, ...: a damaged file, one line naming it
        raise CheckpointError(
            f"{path}: a truncated or corrupt DCP metadata file: {type(exc).__name__}: {first_line(str(exc))}"
        ) from exc
    if not isinstance(getattr(meta, "state_dict_metadata", None), Mapping) or not isinstance(
        getattr(meta, "storage_data", None), Mapping
    ):
        raise CheckpointError(f"{path}: not torch.distributed.checkpoint metadata (no state_dict_metadata)")
    return meta


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of an open file (one DCP item)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._start, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._length - self._pos)
        if size <= 0:
            return 0
        self._handle.seek(self._start + self._pos)
        data = self._handle.read(size)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class _Item:
    file: str  # relative to the folder
    offset: int
    length: int
    chunk_offsets: tuple[int, ...]  # where this chunk sits in the whole tensor (empty for bytes items)


class DcpReader:
    """Reads the items of one DCP folder on demand; holds only the metadata."""

    def __init__(self, folder: Path, allow_globals: Sequence[str] = ()) -> None:
        self.folder = folder
        self.allow_globals = tuple(allow_globals)
        self.metadata = read_metadata(folder, allow_globals)
        self.items: dict[str, list[_Item]] = {}
        for index, info in self.metadata.storage_data.items():
            fqn = str(getattr(index, "fqn", ""))
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{folder}: {fqn} is stored through DCP stream transforms ({info.transform_descriptors}), "
                    "which ampdoctor does not read; save the checkpoint without them"
                )
            offsets = getattr(index, "offset", None)
            item = _Item(str(info.relative_path), int(info.offset), int(info.length), tuple(offsets or ()))
            self.items.setdefault(fqn, []).append(item)
        root = folder.resolve()
        for name in self.files():  # every file the metadata names: inside the folder, and there
            if Path(name).is_absolute() or not (root / name).resolve().is_relative_to(root):
                raise CheckpointError(f"{folder}: its metadata names a data file outside the folder ({name}): refused")
        absent = [name for name in self.files() if not (folder / name).is_file()]
        if absent:
            raise CheckpointError(
                f"{folder}: incomplete: its metadata names {', '.join(absent)}, which "
                f"{'is' if len(absent) == 1 else 'are'} not in the folder (an unfinished copy?)"
            )

    def files(self) -> list[str]:
        return sorted({i.file for items in self.items.values() for i in items})

    @staticmethod
    def size_on_disk(folder: Path) -> int:
        """The bytes of the metadata and the data files (nothing read)."""
        return sum(p.stat().st_size for p in folder.iterdir() if p.name == METADATA_FILE or p.suffix == DATA_SUFFIX)

    def is_tensor(self, fqn: str) -> bool:
        return hasattr(self.metadata.state_dict_metadata.get(fqn), "chunks")

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[fqn].size)

    def _load(self, item: _Item, fqn: str) -> Any:
        import torch

        path = self.folder / item.file  # checked to lie inside the folder when the metadata was read
        allowed = [resolve_global(n) for n in self.allow_globals]
        try:
            with open(path, "rb") as handle, torch.serialization.safe_globals(allowed):
                window = io.BufferedReader(_Window(handle, item.offset, item.length))
                return torch.load(window, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            named = [n for n in _GLOBAL_IN_MESSAGE.findall(str(exc)) if n not in self.allow_globals]
            if named:
                raise refusal(f"{path} ({fqn})", named) from exc
            raise CheckpointError(f"{path}: {fqn} is truncated or corrupt: {first_line(str(exc))}") from exc
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read {fqn}: {exc.strerror or exc}") from exc
        except Exception as exc:  # a damaged blob: one line naming the file and the key
            raise CheckpointError(
                f"{path}: {fqn} is truncated or corrupt: {type(exc).__name__}: {first_line(str(exc))}"
            ) from exc

    def read(self, fqn: str) -> Any:
        """The value saved under ``fqn``: a whole tensor (its chunks assembled), or a small Python object."""
        items = self.items.get(fqn)
        if not items:
            raise CheckpointError(f"{self.folder}: the metadata names {fqn}, but no .distcp file holds it")
        if not self.is_tensor(fqn):
            return self._load(items[0], fqn)
        first = self._load(items[0], fqn)
        if len(items) == 1 and tuple(first.shape) == self.shape(fqn):
            return first
        return self._assemble(fqn, items, first)

    def _assemble(self, fqn: str, items: list[_Item], first: torch.Tensor) -> torch.Tensor:
        """A tensor saved in chunks (one per rank): each chunk copied into place, one chunk in memory at a time."""
        import torch

        props = self.metadata.state_dict_metadata[fqn].properties
        whole = torch.empty(self.shape(fqn), dtype=props.dtype)
        for n, item in enumerate(items):
            chunk = first if n == 0 else self._load(item, fqn)
            target = whole
            for dim, (start, size) in enumerate(zip(item.chunk_offsets or (0,) * whole.dim(), chunk.shape)):
                target = target.narrow(dim, start, size)
            target.copy_(chunk)
            del chunk, target
        del first
        return whole


Node = Union["DcpTree", list[Any], str]


class DcpTree(Mapping[Any, Any]):
    """One level of a DCP checkpoint as a read-only mapping; values are read when asked for (see the module)."""

    def __init__(self, reader: DcpReader, children: dict[Any, Any]) -> None:
        self._reader = reader
        self._children = children  # key -> DcpTree, list, or the fqn of a leaf
        self._lists: dict[Any, list[Any]] = {}  # lists read once (a walk may key on their identity)

    @classmethod
    def of(cls, reader: DcpReader) -> DcpTree:
        planner = getattr(reader.metadata, "planner_data", None) or {}
        root: dict[Any, Any] = {}
        for fqn in reader.metadata.state_dict_metadata:
            path = planner.get(fqn) if isinstance(planner, Mapping) else None
            parts = tuple(path) if isinstance(path, (tuple, list)) and path else tuple(str(fqn).split("."))
            node = root
            for part in parts[:-1]:
                child = node.get(part)
                if not isinstance(child, dict):
                    child = node[part] = {}
                node = child
            node[parts[-1]] = str(fqn)
        return cls._build(reader, root)

    @classmethod
    def _build(cls, reader: DcpReader, raw: dict[Any, Any]) -> DcpTree:
        children: dict[Any, Any] = {}
        for key, value in raw.items():
            if isinstance(value, dict):
                if value and all(isinstance(k, int) for k in value):  # a list in the saved state (param_groups)
                    children[key] = [cls._build(reader, {0: value[k]})._children[0] for k in sorted(value)]
                else:
                    children[key] = cls._build(reader, value)
            else:
                children[key] = value
        return cls(reader, children)

    def _value(self, child: Any) -> Any:
        if isinstance(child, DcpTree):
            return child
        if isinstance(child, list):  # small lists (param_groups): read whole
            return [self._value(c) for c in child]
        return self._reader.read(child)

    def __getitem__(self, key: Any) -> Any:
        child = self._children[key]
        if isinstance(child, list):
            if key not in self._lists:
                self._lists[key] = self._value(child)
            return self._lists[key]
        return self._value(child)

    def branches(self) -> Iterator[tuple[Any, Any]]:
        """(key, value) of the nested levels and lists only: no tensor is read."""
        for key, child in self._children.items():
            if not isinstance(child, str):
                yield key, self[key]

    def __contains__(self, key: object) -> bool:
        return key in self._children

    def __iter__(self) -> Iterator[Any]:
        return iter(self._children)

    def __len__(self) -> int:
        return len(self._children)

    def tensor_keys(self) -> list[Any]:
        """The keys of this level that hold tensors (known from the metadata, nothing read)."""
        return [k for k, c in self._children.items() if isinstance(c, str) and self._reader.is_tensor(c)]

    def subtrees(self, skip: Callable[[DcpTree], bool] = lambda tree: False) -> Iterator[DcpTree]:
        """This level and every level below it, outermost first, leaving out the levels ``skip`` names and all
        below them (no tensor is read)."""
        if skip(self):
            return
        yield self
        for child in self._children.values():
            if isinstance(child, DcpTree):
                yield from child.subtrees(skip)

    def tensors_only(self) -> Mapping[Any, Any]:
        """This level's tensors as a mapping (each read when asked for)."""
        return _Leaves(self, self.tensor_keys())


class _Leaves(Mapping[Any, Any]):
    def __init__(self, tree: DcpTree, keys: list[Any]) -> None:
        self._tree, self._keys = tree, keys

    def __getitem__(self, key: Any) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._tree[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
