"""Writing ampdoctor's output files: atomically, never over an input, with the user's umask.

An output is written by :func:`ampdoctor.atomic.write_text_atomically`: a temporary file in the destination's own
folder moved into place with ``os.replace``, so the destination appears whole or not at all (Ctrl-C included),
and gets a new inode, so a file hard-linked to it elsewhere keeps its bytes. An output that *is* one of the
inputs (the same inode: the same path, a hard link, or a symlink to it), or lies inside an input directory, is
refused before anything runs. An output that is a symlink elsewhere is written through (the link stays a link).
``-`` and ``/dev/stdout`` go to standard output, and other non-regular files (``/dev/null``, a pipe) are written
directly.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

from ..atomic import PathLike, write_text_atomically
from ..errors import InvalidInput

STDOUT_NAMES = ("-", "/dev/stdout")


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
    try:
        write_text_atomically(output, text)
    except OSError as exc:
        raise InvalidInput(f"cannot write {output}: {exc.strerror or exc}") from exc
