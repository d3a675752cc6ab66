"""What a global a pickle names can do, from its name alone (nothing is imported): a known-harmless data type,
code execution, unknown, or no name at all. The refusal messages and both loading paths (``weights_only`` and the
``--unsafe-load`` allow-list) classify globals here.
"""

from __future__ import annotations

import re
import sys
from typing import Literal

from .sniff import COMPUTED_GLOBAL

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
    logging _posixshmem mmap resource fcntl select selectors ssl _ssl sqlite3 _sqlite3 dbm shelve
    """.split()
)
_CODE_NAMES = tuple(
    """
    torch.load torch.hub torch.jit torch.ops torch._ops torch._C torch.serialization torch.fx torch.package
    torch.library torch._library torch._dynamo torch._inductor torch.compiler torch.multiprocessing
    torch.distributed.rpc torch.utils.cpp_extension torch.utils.tensorboard torch.utils.file_baton
    torch._weights_only_unpickler torch.ao.quantization.fx torch.compile torch.PyTorchFileWriter
    torch.PyTorchFileReader torch.ScriptModuleSerializer torch.ScriptModule torch.ScriptFunction torch.ScriptMethod
    torch.ScriptObject torch.ScriptClass torch.StaticModule torch.LiteScriptModule torch.ThroughputBenchmark
    torch._TorchCompileWrapper torch._TorchCompileInductorWrapper torch._TorchCompileAOTInductorWrapper
    numpy.load numpy.lib.npyio numpy.lib._npyio_impl numpy.lib._datasource numpy.memmap numpy.testing numpy.f2py
    numpy.distutils numpy.ctypeslib
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
            if cut < len(parts) - 1:
                break  # module.sub.name with module.sub not imported (yet): unknown, not corrupt
            if not hasattr(module, parts[-1]):
                return "corrupt"  # a name the imported module does not have: damaged bytes, or another version
            break
    return "unknown"


def is_harmless_name(name: str) -> bool:
    """One of the known-harmless data types a refusal may suggest allowing."""
    return name in HARMLESS_GLOBALS or bool(_HARMLESS_PATTERN.fullmatch(name))


