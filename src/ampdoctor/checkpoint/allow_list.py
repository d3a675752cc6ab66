"""What ``--unsafe-load`` admits, enforced while the file is unpickled (an allow-list, not a deny-list).

``torch.load(weights_only=False)`` is given a pickle module of ours (:func:`restricted_pickle`) whose
``Unpickler.find_class`` decides every global of every pickle torch reads (a zip file's ``data.pkl``; the five
pickles of a legacy file; nothing else is unpickled). It admits, and nothing more:

- what ``torch.load(weights_only=True)`` admits (torch's own table) and the names given with ``--allow-global``;
- the known-harmless data types of :data:`~.global_names.HARMLESS_GLOBALS` (Python containers, ``argparse.Namespace``,
  ``datetime``, numpy's array reconstruction and RNG state) and the two ``copyreg`` helpers that rebuild objects
  of admitted classes;
- classes (never functions) defined in the data-carrying parts of torch (:data:`TORCH_CLASS_MODULES`: tensors,
  ``torch.nn`` modules, optimizers, LR schedulers, GradScaler, distributions), except classes built on the parts
  that compile or run code (:data:`TORCH_CODE_MODULES`: ``torch.fx``, ``torch.jit``, ``torch.package`` ...);
- numpy's arrays (``memmap`` aside), dtypes, scalar types and random generators;
- every global of the module given with ``--model`` and of the packages named with ``--trust`` (API ``trust=``),
  submodules included.

Everything else is refused before anything of it is imported, naming the global and, where one exists, the flag
that would admit it. A global that can run code (:func:`~.global_names.classify_global`) is never admitted, whatever
the flags. Nothing here imports a module the policy has not already admitted by name.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any, Optional

from ..errors import InvalidInput
from .global_names import HARMLESS_GLOBALS, classify_global, is_harmless_name
from .sniff import python3_name

# Parts of torch whose classes hold data; a class is admitted when the module that defines it is one of these or
# below one of these.
TORCH_CLASS_MODULES = (
    "torch",  # exactly the top-level module, and only TORCH_TOP_CLASSES (its C++ bindings hold the JIT's classes)
    "torch._tensor",
    "torch.storage",
    "torch.types",
    "torch.torch_version",
    "torch.return_types",
    "torch.nn",
    "torch.optim",
    "torch.amp",
    "torch.cuda.amp",
    "torch.cpu.amp",
    "torch.distributions",
    "torch.ao.nn",
    "torch.ao.quantization",
)
# The classes whose home is the top-level ``torch`` module that are admitted, plus the legacy typed tensors and
# storages (torch.FloatTensor, torch.HalfStorage ...). The C++ bindings also register ScriptModule, Graph,
# PyTorchFileWriter (writes files), _TorchCompileInductorWrapper (compiles) ... there: none of those.
TORCH_TOP_CLASSES = frozenset(
    "Size dtype device layout memory_format qscheme finfo iinfo Tensor Storage SymInt SymFloat SymBool".split()
)
_TORCH_TYPED = re.compile(r"(?:BFloat16|Half|Float|Double|ComplexFloat|ComplexDouble|Bool|Byte|Char|Short|Int|Long"
                          r"|QInt8|QInt32|QUInt8|QUInt4x2|QUInt2x4)(?:Tensor|Storage)")  # fmt: skip
# Parts of torch that compile, generate or run code, spawn processes or write files: no class defined in (or
# inheriting from) one of these is admitted, and a global naming one is not even imported.
TORCH_CODE_MODULES = (
    "torch.fx",
    "torch.jit",
    "torch.package",
    "torch.hub",
    "torch._C",
    "torch.ops",
    "torch._ops",
    "torch.library",
    "torch._library",
    "torch._dynamo",
    "torch._inductor",
    "torch.compiler",
    "torch.export",
    "torch._export",
    "torch._higher_order_ops",
    "torch.distributed",
    "torch.multiprocessing",
    "torch.utils",
    "torch.serialization",
    "torch._weights_only_unpickler",
    "torch.backends",
    "torch.onnx",
    "torch.profiler",
    "torch.autograd.profiler",
    "torch.testing",
    "torch.ao.quantization.fx",
    "torch.ao.quantization.quantize_fx",
    "torch.ao.quantization.pt2e",
    "torch.ao.quantization.quantizer",
)
# Names under numpy that are never imported for a pickle (file I/O, compilers, test tools).
NUMPY_CODE_MODULES = (
    "numpy.f2py",
    "numpy.distutils",
    "numpy.testing",
    "numpy.ctypeslib",
    "numpy.lib.npyio",
    "numpy.lib._npyio_impl",
    "numpy.lib._datasource",
    "numpy.lib.format",
    "numpy._pytesttester",
)
# Rebuild an object of a class the pickle names separately (and that was admitted on its own): protocols 0-1
# pickle objects through _reconstructor, protocol 2+ may name __newobj__.
_COPYREG_HELPERS = frozenset({"copyreg._reconstructor", "copyreg.__newobj__", "copyreg.__newobj_ex__"})
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
# Modules --trust cannot name: they are admitted by class above (trusting them whole would admit torch.load,
# numpy's file readers ...), or they mean the saving script, or the standard library's code runners.
_UNTRUSTABLE = ("torch", "numpy", "__main__", "__mp_main__", "copyreg", "collections", "argparse", "datetime")


def under(module: str, prefixes: Iterable[str]) -> bool:
    """``module`` is one of ``prefixes`` or a submodule of one."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


class GlobalRefused(pickle.UnpicklingError):
    """The loading policy refused a global of the pickle being read; ``name`` is ``module.name``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"ampdoctor's loading policy refused the global {name}")
        self.name = name


def check_trusted(name: str) -> str:
    """A ``--trust`` package name, checked without importing it: dotted syntax, not a module that runs code, not
    torch or numpy as a whole (their data classes are admitted already)."""
    cleaned = name.strip()
    if not _MODULE_NAME.fullmatch(cleaned):
        raise InvalidInput(f"--trust {name!r}: write a package or module name, e.g. mypkg or mypkg.models")
    if under(cleaned, _UNTRUSTABLE):
        raise InvalidInput(
            f"--trust {cleaned}: cannot be trusted as a whole (torch's and numpy's data classes are admitted "
            "already; their functions can load files and run code)"
        )
    if classify_global(f"{cleaned}.x") == "code" or under(cleaned, TORCH_CODE_MODULES):
        raise InvalidInput(
            f"--trust {cleaned}: it can run code; ampdoctor never admits it (a checkpoint that needs it is likely "
            "malicious)"
        )
    return cleaned


@dataclass(frozen=True)
class LoadPolicy:
    """What an unsafe load admits besides the built-in list: ``--allow-global`` names, the ``--model`` module and
    the ``--trust`` packages."""

    allow_globals: tuple[str, ...] = ()
    trusted: tuple[str, ...] = ()
    _table: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def admit(self, module: str, name: str, load: Any) -> Any:
        """The object ``module.name`` refers to, when the policy admits it; else raises :class:`GlobalRefused`.
        ``load(module, name)`` imports and looks up (the unpickler's own ``find_class``): called only for a name
        already admitted by its module."""

        if not isinstance(module, str) or not isinstance(name, str):
            raise GlobalRefused(f"{module!r}.{name!r}")
        module, name = python3_name(module, name)
        full = f"{module}.{name}"
        table = self._torch_table()
        if full in table:
            return table[full]
        if classify_global(full) == "code":
            raise GlobalRefused(full)
        if full in self.allow_globals or full in HARMLESS_GLOBALS or full in _COPYREG_HELPERS or is_harmless_name(full):
            return load(module, name)
        if self.trusted and under(module, self.trusted):
            return _not_code(full, load(module, name))
        if under(module, ("torch",)) and not under(module, TORCH_CODE_MODULES):
            obj = load(module, name)
            if _torch_data_class(obj):
                return obj
        elif under(module, ("numpy",)) and not under(module, NUMPY_CODE_MODULES):
            obj = load(module, name)
            if _numpy_data_class(obj):
                return obj
        raise GlobalRefused(full)

    def _torch_table(self) -> dict[str, Any]:
        if not self._table:
            import torch

            getter = getattr(torch._weights_only_unpickler, "_get_allowed_globals", None)
            self._table.update(getter() if callable(getter) else {})
        return self._table


def _not_code(full: str, obj: Any) -> Any:
    """``obj`` unless it is a module, or its real home is code (``mypkg.os.system`` is ``posix.system``)."""
    if isinstance(obj, ModuleType):
        raise GlobalRefused(full)
    home, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(home, str) and isinstance(qualname, str) and classify_global(f"{home}.{qualname}") == "code":
        raise GlobalRefused(full)
    return obj


def _torch_top_class(cls: type) -> bool:
    return cls.__name__ in TORCH_TOP_CLASSES or bool(_TORCH_TYPED.fullmatch(cls.__name__))


def _torch_data_class(obj: Any) -> bool:
    """A class defined in torch's data modules, none of whose bases lives where code is compiled or run."""
    if not isinstance(obj, type):
        return False
    mro = [(getattr(c, "__module__", "") or "", c) for c in obj.__mro__]
    home = mro[0][0]
    if not (home == "torch" or under(home, TORCH_CLASS_MODULES[1:])):
        return False
    for module, cls in mro:
        if under(module, TORCH_CODE_MODULES) or (module == "torch" and not _torch_top_class(cls)):
            return False
    return True


def _numpy_data_class(obj: Any) -> bool:
    import numpy

    if not isinstance(obj, type) or issubclass(obj, numpy.memmap):
        return False
    if issubclass(obj, (numpy.ndarray, numpy.dtype, numpy.generic)):
        return True
    random = numpy.random
    kinds = tuple(
        k
        for k in (
            getattr(random, "Generator", None),
            getattr(random, "RandomState", None),
            getattr(random, "BitGenerator", None),
            getattr(random, "SeedSequence", None),
        )
        if isinstance(k, type)
    )
    return bool(kinds) and issubclass(obj, kinds)


def restricted_pickle(policy: LoadPolicy) -> Any:
    """A pickle module for ``torch.load(pickle_module=...)``: ``Unpickler`` (torch subclasses it, and sets its
    ``persistent_load``) and ``load`` (torch reads a legacy file's other pickles with it), both admitting only
    what ``policy`` admits."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return policy.admit(module, name, super().find_class)

    def load(file: Any, **kwargs: Any) -> Any:
        return Unpickler(file, **kwargs).load()

    def loads(data: bytes, **kwargs: Any) -> Any:
        import io

        return load(io.BytesIO(data), **kwargs)

    return SimpleNamespace(
        __name__="ampdoctor_restricted_pickle",
        Unpickler=Unpickler,
        load=load,
        loads=loads,
        UnpicklingError=pickle.UnpicklingError,
    )


def refused_global(exc: BaseException) -> Optional[str]:
    """The global the policy refused, when ``exc`` (or what caused it) is that refusal."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, GlobalRefused):
            return current.name
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def trusted_roots(packages: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(check_trusted(p) for p in packages if p.strip()))
