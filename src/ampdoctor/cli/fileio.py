"""Writing ampdoctor's output files: atomically, never over an input, with the user's umask.

An output is written to a temporary file in the destination's own folder and moved into place with
``os.replace``: the destination appears whole or not at all (Ctrl-C included), and gets a new inode, so a file
hard-linked to it elsewhere keeps its bytes. An output that *is* one of the inputs (the same inode: the same
path, a hard link, or a symlink to it), or lies inside an input directory, is refused before anything runs. An
output that is a symlink elsewhere is written through (the link stays a link). ``-`` and ``/dev/stdout`` go to
standard output, and other non-regular files (``/dev/null``, a pipe) are written directly.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional, Union

from ..errors import InvalidInput

PathLike = Union[str, "os.PathLike[str]"]
STDOUT_NAMES = ("-", "/dev/stdout")
_DEFAULT_FILE_MODE = 0o666  # what open(..., "w") asks for before the umask


def current_umask() -> int:
    """The process umask (read from /proc where possible; else set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass  # not Linux, or an old kernel: the portable way below
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _files_of(path: Path) -> Iterator[Path]:
    """``path`` itself and, for a directory, every file below it."""
    yield path
    if path.is_dir():
        for folder, _, names in os.walk(path):
            for name in names:
                yield Path(folder) / name


def _identities(paths: Iterable[PathLike]) -> dict[tuple[int, int], str]:
    """(device, inode) of every input file (and directory), following symlinks -> that file's path."""
    found = {}
    for given in paths:
        for path in _files_of(Path(given)):
            try:
                st = path.stat()
            except OSError:
                continue  # a dangling link or a file removed meanwhile cannot be written over
            found[(st.st_dev, st.st_ino)] = str(path)
    return found


def check_output(output: Optional[str], inputs: Iterable[PathLike] = ()) -> None:
    """Refuse ``-o output`` when it is an input (same inode: the path, a hard link, a symlink to it) or lies in an
    input directory, when it is a directory, or when its folder does not exist. Cheap: call it before the work."""
    if output is None or output in STDOUT_NAMES:
        return
    inputs = [Path(p) for p in inputs]
    real = Path(os.path.realpath(output))
    for given in inputs:
        folder = Path(os.path.realpath(given))
        if folder.is_dir() and folder in real.parents:
            raise InvalidInput(
                f"-o {output}: that is inside the input directory {given}; ampdoctor never writes "
                "there, choose a file elsewhere"
            )
    if os.path.exists(output):  # only an existing path can be the same file (samefile raises on a new one)
        st = os.stat(output)
        same = _identities(inputs).get((st.st_dev, st.st_ino))
        if same is not None:
            if os.path.islink(output):
                what = f"a symlink to the input {same}"
            elif os.path.realpath(output) != os.path.realpath(same):
                what = f"a hard link to the input {same}"
            else:
                what = f"the input {same}"
            raise InvalidInput(
                f"-o {output}: that is {what}; ampdoctor never writes over an input, choose another file"
            )
        if stat.S_ISDIR(st.st_mode):
            raise InvalidInput(f"cannot write {output}: it is a directory; give a file name")
    if not real.parent.is_dir():
        raise InvalidInput(f"cannot write {output}: no such directory {real.parent}")


def write_output(text: str, output: Optional[str], inputs: Iterable[PathLike] = ()) -> None:
    """Write ``text`` to standard output (``None``, ``-``, ``/dev/stdout``) or atomically to the file ``output``.

    Raises :class:`InvalidInput` (one line) when the output is an input or cannot be written; on any exception,
    Ctrl-C included, the destination is left as it was and no temporary file remains.
    """
    if output is None or output in STDOUT_NAMES:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader (head, less) closed the pipe: it saw what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and Python's exit flush stays quiet
        return
    check_output(output, inputs)
    real = os.path.realpath(output)  # a symlink elsewhere is written through: the link stays a link
    try:
        existing = os.stat(real)
    except FileNotFoundError:
        existing = None
    try:
        if existing is not None and not stat.S_ISREG(existing.st_mode):
            with open(real, "w", encoding="utf-8") as fh:  # /dev/null, a named pipe: nothing to replace
                fh.write(text)
            return
        mode = stat.S_IMODE(existing.st_mode) if existing else _DEFAULT_FILE_MODE & ~current_umask()
        _replace(real, text, mode)
    except OSError as exc:
        raise InvalidInput(f"cannot write {output}: {exc.strerror or exc}") from exc


def _replace(path: str, text: str, mode: int) -> None:
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # mkstemp makes 0600; the user's umask decides, as for any new file
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
