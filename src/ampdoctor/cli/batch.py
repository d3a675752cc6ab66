"""The batch of ``ampdoctor diagnose``: from a file (loaded under the checkpoint loading policy), from a Python
function (``--batch MODULE:FUNCTION``), and which part of it the model receives (``--model-inputs``).

A batch is what a ``DataLoader`` yields: a tensor, a tuple/list (``(inputs, targets)``) or a dict. The model
receives it by the API's rule (a tensor -> ``model(x)``, a tuple/list -> ``model(*batch)``, a dict ->
``model(**batch)``), or receives only the part ``--model-inputs`` names, by the same rule; ``--loss FN`` always
gets ``FN(output, batch)`` with the whole batch, targets included.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ..errors import InvalidInput
from .common import user_code

if TYPE_CHECKING:
    import torch

_INDICES = re.compile(r"^\d+(,\d+)*$")
_KEYS = re.compile(r"^[^,\s]+(,[^,\s]+)*$")
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

Selection = Union[tuple[int, ...], tuple[str, ...]]


def is_function_spec(text: str) -> bool:
    """``--batch pkg.module:make_batch`` (and no file of that name): a function that returns the batch."""
    return bool(_SPEC.match(text)) and not os.path.exists(text)


def check_batch_argument(text: str) -> None:
    """A file that exists, or ``MODULE:FUNCTION`` (checked for syntax only: nothing is imported yet)."""
    if Path(text).is_file() or is_function_spec(text):
        return
    if os.path.exists(text):
        raise InvalidInput(f"--batch {text}: not a regular file")
    raise InvalidInput(f"--batch {text}: no such file (or write MODULE:FUNCTION for a function returning the batch)")


def parse_selection(text: str) -> Selection:
    """``--model-inputs 0`` / ``0,1`` (tuple positions) or ``input_ids,attention_mask`` (dict keys)."""
    cleaned = text.strip()
    if _INDICES.match(cleaned):
        return tuple(int(i) for i in cleaned.split(","))
    if _KEYS.match(cleaned):
        return tuple(cleaned.split(","))
    raise InvalidInput(
        f"--model-inputs {text!r}: give positions of the batch tuple (0 or 0,1) or keys of the batch dict "
        "(input_ids,attention_mask), comma-separated, no spaces"
    )


def _plain(batch: Any, where: str) -> Any:
    """A batch as the API takes it (a list becomes a tuple); anything else is refused naming what it is."""
    import torch

    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, (torch.Tensor, tuple, Mapping)):
        raise InvalidInput(
            f"{where}: holds a {type(batch).__name__}; expected a tensor, a tuple/list (e.g. (inputs, targets)) "
            "or a dict, as a DataLoader yields"
        )
    return batch


def load_batch(
    text: str,
    import_function: Callable[[str, str], Callable[..., Any]],
    allow_globals: Sequence[str] = (),
    unsafe_load: bool = False,
) -> Any:
    """The batch from ``--batch``: a function's return value (``import_function(spec, "--batch")`` finds it),
    .npy/.npz (no pickles), or a torch file loaded like a checkpoint (weights_only, the pickle checked first,
    ``--allow-global`` / ``--unsafe-load``)."""
    if is_function_spec(text):
        return _batch_from_function(text, import_function(text, "--batch"))
    import numpy as np
    import torch

    path = Path(text)
    if not path.is_file():
        raise InvalidInput(f"--batch {text}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        try:
            if suffix == ".npy":
                return torch.from_numpy(np.load(path, allow_pickle=False))
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: torch.from_numpy(data[k]) for k in data.files}
        except Exception as exc:  # numpy raises many types for a bad file: one line naming it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidInput(
                f"--batch {text}: not a readable batch ({type(exc).__name__}: {first}); save an array with "
                "numpy.save (.npy) / numpy.savez (.npz), or a tensor, tuple or dict with torch.save (.pt)"
            ) from exc
        if arrays and all(re.fullmatch(r"arr_\d+", k) for k in arrays):
            ordered = [arrays[k] for k in sorted(arrays, key=lambda k: int(k[4:]))]
            return ordered[0] if len(ordered) == 1 else tuple(ordered)
        return arrays
    from ..checkpoint.safe_load import load_file

    obj = load_file(path, allow_globals, unsafe_load).obj  # its errors name the file
    if not isinstance(obj, (torch.Tensor, tuple, list, dict)):  # a safetensors file: a dict of its tensors
        obj = {k: obj[k] for k in obj} if isinstance(obj, Mapping) else obj
    return _plain(obj, f"--batch {text}")


def _batch_from_function(spec: str, make: Callable[..., Any]) -> Any:
    try:
        with user_code(f"--batch {spec}: the function"):
            batch = make()
    except InvalidInput:
        raise
    except Exception as exc:  # the user's function: one line naming it and what it raised
        raise InvalidInput(f"--batch {spec}: calling it raised {type(exc).__name__}: {exc}") from exc
    return _plain(batch, f"--batch {spec} returned a batch that")


def select_inputs(batch: Any, selection: Selection, source: str) -> Any:
    """The part of ``batch`` the model receives: one element as it is, several as a tuple (positions) or a dict
    (keys). Raises InvalidInput naming what the batch holds when the selection does not fit it."""
    import torch

    if isinstance(batch, torch.Tensor):
        raise InvalidInput(f"--model-inputs: {source} is a single tensor (no targets to leave out); drop the option")
    if isinstance(batch, Mapping):
        keys = [str(k) for k in batch]
        missing = [s for s in selection if str(s) not in keys]
        if missing:
            raise InvalidInput(
                f"--model-inputs {','.join(map(str, selection))}: {source} is a dict without "
                f"{', '.join(map(str, missing))}; its keys: {', '.join(keys)}"
            )
        by_name = {str(k): v for k, v in batch.items()}
        return {str(s): by_name[str(s)] for s in selection}
    if not all(isinstance(s, int) for s in selection) or any(int(s) >= len(batch) for s in selection):
        raise InvalidInput(
            f"--model-inputs {','.join(map(str, selection))}: {source} is a tuple of {len(batch)} element(s); give "
            f"positions 0 to {len(batch) - 1}"
        )
    parts = tuple(batch[int(s)] for s in selection)
    return parts[0] if len(parts) == 1 else parts


def describe(batch: Any) -> str:
    """'a tuple of 2 (Tensor [8, 16], Tensor [8])' for error hints."""
    import torch

    def one(value: Any) -> str:
        return f"Tensor {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__

    if isinstance(batch, torch.Tensor):
        return one(batch)
    if isinstance(batch, Mapping):
        return "a dict (" + ", ".join(f"{k}: {one(v)}" for k, v in batch.items()) + ")"
    return f"a tuple of {len(batch)} (" + ", ".join(one(v) for v in batch) + ")"


def to_device(batch: Any, device: torch.device) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple):
        return tuple(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
