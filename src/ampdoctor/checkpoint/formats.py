"""Checkpoint layouts beyond single files and folders of shards: what ``scan`` and ``load_weights`` read.

- ``torch.distributed.checkpoint`` folders (``.metadata`` + ``*.distcp``, FSDP2's format): one entry, read
  tensor by tensor without a process group (:mod:`.dcp`).
- Accelerate ``save_state`` folders (``model.safetensors`` or ``pytorch_model.bin``, ``optimizer.bin``,
  ``scaler.pt``; ``random_states_0.pkl`` is RNG state only and is not read), Hugging Face sharded folders with
  an index (``model-00001-of-00002.safetensors`` ...), Lightning ``.ckpt`` files (``state_dict``,
  ``optimizer_states``, the GradScaler state under ``MixedPrecision`` or ``native_amp_scaling_state``): their
  files are the ordinary kinds, read one at a time by :mod:`.safe_load`; optimizer and GradScaler state are
  recognised by their shape wherever they sit.

Every byte goes through the loading policy: :func:`~.safe_load.load_file` for files, torch's weights-only
unpickler for DCP's metadata and items.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from ..errors import CheckpointError
from .dcp import DcpReader, DcpTree, is_dcp_folder
from .listing import Listing, list_checkpoint
from .safe_load import LoadedFile, load_file

__all__ = ["DcpTree", "checkpoint_entries", "entry_size", "is_dcp_folder", "load_entry"]


def checkpoint_entries(root: Path) -> Listing:
    """What a scan reads one at a time: a DCP folder as one entry; else the checkpoint files of the listing (with
    the entries it could not read, :func:`~.listing.list_checkpoint`), and the DCP folders directly inside a folder
    (Accelerate's FSDP ``save_state`` writes ``pytorch_model_fsdp_0/``, ``optimizer_0/``)."""
    if is_dcp_folder(root):
        return Listing((root,))
    inner = sorted(p for p in root.iterdir() if is_dcp_folder(p)) if root.is_dir() else []
    try:
        listing = list_checkpoint(root)
    except CheckpointError:
        if not inner:
            raise
        listing = Listing(())
    return dataclasses.replace(listing, files=tuple(sorted([*listing.files, *inner], key=lambda p: p.name)))


def load_entry(
    path: Path,
    allow_globals: Sequence[str] = (),
    unsafe_load: bool = False,
    trust: Sequence[str] = (),
    file_loader: Callable[[Path, Sequence[str], bool, Sequence[str]], LoadedFile] = load_file,
) -> LoadedFile:
    """One entry's contents: a DCP folder as a :class:`DcpTree` (``unsafe_load`` never applies to it: its
    pickles are read by allow-list unpicklers only), anything else through ``file_loader`` (:func:`load_file`)."""
    if is_dcp_folder(path):
        return LoadedFile(DcpTree.of(DcpReader(path, allow_globals)), cast(Any, "dcp"), False, {})
    return file_loader(path, allow_globals, unsafe_load, trust)


def entry_size(path: Path) -> int:
    """Bytes on disk: a DCP folder's metadata and data files, or the file's size."""
    if is_dcp_folder(path):
        return DcpReader.size_on_disk(path)
    return path.stat().st_size
