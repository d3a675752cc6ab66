"""Loading a checkpoint's weights into the user's model (``ampdoctor diagnose CKPT --model ...``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..capture.model import strip_wrapper_prefixes
from ..capture.progress import NO_PROGRESS, Progress
from ..errors import CheckpointError, CheckpointRefused, InvalidInput
from ..records import FrozenMap
from ..report.inert import inert
from .formats import DcpTree, checkpoint_entries, load_entry
from .safe_load import SafetensorsMapping, is_malicious, refusal
from .scan import _MAX_DEPTH, is_optimizer_state, is_scaler_state, join_key, number

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_weights` put into the model and what else the checkpoint said."""

    files: tuple[str, ...]
    tensors: int
    saved_on: FrozenMap[str, int]
    scaler_scale: Optional[float]  # the first GradScaler state's scale, when the checkpoint has one
    scaler_path: str = ""

    @property
    def saved_from_cuda(self) -> bool:
        return any(device.startswith("cuda") for device in self.saved_on)


def _tensor_mappings(obj: Any, depth: int = 0) -> Iterator[Mapping[str, Any]]:
    """Every mapping in ``obj`` whose values include tensors (candidate state dicts), outermost first."""
    import torch

    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, torch.nn.Module):
        yield obj.state_dict()
        return
    if isinstance(obj, SafetensorsMapping):
        yield obj
        return
    if isinstance(obj, DcpTree):  # its levels holding tensors, known from the metadata: nothing is read here
        skip = lambda tree: is_optimizer_state(tree) or is_scaler_state(tree)  # noqa: E731
        yield from (tree.tensors_only() for tree in obj.subtrees(skip) if tree.tensor_keys())
        return
    if isinstance(obj, Mapping):
        if is_optimizer_state(obj) or is_scaler_state(obj):
            return
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            yield obj
        for value in obj.values():
            if isinstance(value, (Mapping, list, tuple, torch.nn.Module)):
                yield from _tensor_mappings(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensor_mappings(value, depth + 1)


def _normalise_keys(keys: Iterable[str], wanted: set[str]) -> dict[str, str]:
    """checkpoint key -> model key: wrapper prefixes (DDP ``module.``, ``_orig_mod.``) dropped, and one common
    leading component (``model.``) dropped when that makes the keys match the model's."""
    out = {}
    for key in keys:
        out[key] = strip_wrapper_prefixes(key, wanted)
    if not wanted & set(out.values()):
        heads = {k.split(".", 1)[0] for k in out.values() if "." in k}
        if len(heads) == 1:
            head = heads.pop() + "."
            stripped = {key: k[len(head) :] if k.startswith(head) else k for key, k in out.items()}
            if wanted & set(stripped.values()):
                return stripped
    return out


def _best_state_dict(obj: Any, wanted: set[str]) -> tuple[dict[str, Any], int]:
    """The candidate mapping that shares most keys with the model, renamed to the model's keys."""
    import torch

    best: Optional[tuple[int, Mapping[str, Any], dict[str, str]]] = None
    for mapping in _tensor_mappings(obj):
        names = _normalise_keys([str(k) for k in mapping.keys()], wanted)
        hits = len(wanted & set(names.values()))
        if best is None or hits > best[0]:
            best = (hits, mapping, names)
    if best is None:
        return {}, 0
    hits, source, names = best
    tensors = {}
    for key in source.keys():
        value = source[key]
        if isinstance(value, torch.Tensor):
            tensors[names[str(key)]] = value
    return tensors, hits


def _short_list(items: Sequence[str], n: int = 5) -> str:
    """The first ``n`` names (keys from the file: made inert), then how many there are."""
    return ", ".join(inert(i) for i in items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def load_weights(
    model: nn.Module,
    path: str | Path,
    *,
    allow_globals: Sequence[str] = (),
    unsafe_load: bool = False,
    trust: Sequence[str] = (),
    progress: Optional[Progress] = None,
) -> LoadedWeights:
    """Load a checkpoint's weights into ``model`` (strictly: every key, every shape).

    The state dict is found inside training checkpoints (the nested mapping that matches the model's keys
    best); DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.`` prefixes are dropped. A directory of shards
    is loaded one file at a time, twice: the first round only checks keys and shapes, so a checkpoint that does
    not fit leaves the model untouched. Raises :class:`AmpDoctorError` naming missing and unexpected keys and
    shape mismatches. ``trust``: packages an ``unsafe_load`` admits (see :func:`ampdoctor.scan`). A file of a
    directory that names a global able to run code refuses the whole directory;
    when weights are missing and other files were refused, the refusal is the error (the weights may be there).
    The checkpoint is only read.
    """
    import torch

    if trust and not unsafe_load:
        raise InvalidInput("trust= admits globals only when loading with unsafe_load=True (CLI: --unsafe-load)")
    root = Path(path)
    listing = checkpoint_entries(root)
    files = listing.files
    own = model.state_dict()
    wanted = set(own)
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatched: dict[str, str] = {}  # model key -> description
    locations: dict[str, int] = defaultdict(int)
    scaler: Optional[tuple[float, str]] = None
    used: list[str] = []
    refusals: list[CheckpointRefused] = []
    shown = progress or NO_PROGRESS
    shown.stage("checking the checkpoint", total=len(files))
    for file in files:  # first round: check every file, load nothing
        shown.detail(inert(file.name))
        try:
            loaded = load_entry(file, allow_globals, unsafe_load, trust)
        except CheckpointRefused as refused:
            if not root.is_dir() or is_malicious(refused):
                raise
            refusals.append(refused)
            shown.advance()
            continue
        if scaler is None:
            scaler = _find_scaler(loaded.obj)
        part, hits = _best_state_dict(loaded.obj, wanted)
        if root.is_dir() and hits == 0:
            continue  # optimizer.pt, scheduler.pt, ... in a training checkpoint directory
        used.append(file.name)
        for location in loaded.locations.values():
            locations[location] += 1
        fits: dict[str, torch.Tensor] = {}
        for key, value in part.items():
            if key not in own:
                unexpected.append(key)
            elif tuple(value.shape) != tuple(own[key].shape):
                mismatched[key] = f"{key} (checkpoint {list(value.shape)}, model {list(own[key].shape)})"
            else:
                fits[key] = value
        seen.update(fits)
        del loaded, part, fits
        shown.advance()
    missing = sorted(k for k in wanted - seen - set(mismatched) if not _tied_to(k, own, seen))
    if refusals and (missing or not used):
        where = f"{inert(str(root))} ({', '.join(inert(Path(r.path).name) for r in refusals)})"
        raise refusal(where, [n for r in refusals for n in r.blocking])
    unread = [u for u in listing.unread if u.missed]
    if unread and (missing or not used):
        reasons = "; ".join(f"{inert(u.name)}: {u.reason}" for u in unread)
        raise CheckpointError(
            f"{inert(str(root))}: {len(unread)} checkpoint file(s) could not be read ({reasons}); the weights they "
            "hold are missing: finish the download or copy and try again"
        )
    if not used:
        raise CheckpointError(f"{inert(str(root))}: no file in it holds weights for this model")
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {_short_list(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {_short_list(sorted(unexpected))}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {_short_list(list(mismatched.values()))}")
        raise InvalidInput(
            f"the weights in {inert(str(root))} do not fit the model ({type(model).__name__}): {'; '.join(parts)}; "
            "check that --model and --model-kwargs build the model that was trained"
        )
    shown.stage("loading the weights", total=len(used))
    for name in used:  # second round: everything fits; load one file at a time
        shown.detail(inert(name))
        loaded = load_entry(
            root / name if root.is_dir() and name != root.name else root, allow_globals, unsafe_load, trust
        )
        part, _ = _best_state_dict(loaded.obj, wanted)
        del loaded
        with torch.no_grad():
            model.load_state_dict(part, strict=False)
        del part
        shown.advance()
    shown.close()
    return LoadedWeights(
        files=tuple(used),
        tensors=len(seen),
        saved_on=FrozenMap(locations),
        scaler_scale=None if scaler is None else scaler[0],
        scaler_path="" if scaler is None else scaler[1],
    )


def _tied_to(key: str, own: Mapping[str, Any], loaded: set[str]) -> bool:
    """A tied weight (``lm_head.weight`` sharing ``embed.weight``'s storage) is loaded with its twin: checkpoints
    such as Hugging Face safetensors files store it once."""
    tensor = own[key]
    return any(
        other in loaded and own[other].data_ptr() == tensor.data_ptr() and own[other].shape == tensor.shape
        for other in own
        if other != key
    )


def _find_scaler(obj: Any, name: str = "", depth: int = 0) -> Optional[tuple[float, str]]:
    if depth > _MAX_DEPTH:
        return None
    if isinstance(obj, Mapping):
        if is_scaler_state(obj):
            scale = number(obj.get("scale"))
            return None if scale is None else (scale, name)
        if is_optimizer_state(obj) or isinstance(obj, SafetensorsMapping):
            return None
        items: Iterable[tuple[Any, Any]] = obj.branches() if isinstance(obj, DcpTree) else obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        if isinstance(value, (Mapping, list, tuple)):
            found = _find_scaler(value, join_key(name, key), depth + 1)
            if found is not None:
                return found
    return None
