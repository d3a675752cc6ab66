"""Text files written whole or not at all (standard library only: the CLI and ``Report.save`` share it).

The text is encoded first, then written to a temporary file in the destination's own folder and moved into place
with ``os.replace``: the destination appears whole or not at all (an unencodable text, a full disk and Ctrl-C
included), and gets a new inode, so a file hard-linked to it elsewhere keeps its bytes. A destination that is a
symlink is written through (the link stays a link); one that is not a regular file (``/dev/null``, a named pipe)
is written directly, having nothing to replace.
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]
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


def write_text_atomically(path: PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as described above; an existing file keeps its mode, a new one gets the
    user's umask. Raises ``UnicodeEncodeError`` or ``OSError`` with the destination as it was."""
    data = text.encode("utf-8")  # before anything exists: an unencodable text leaves no file behind
    real = os.path.realpath(path)
    try:
        existing = os.stat(real)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        with open(real, "wb") as fh:
            fh.write(data)
        return
    mode = stat.S_IMODE(existing.st_mode) if existing else _DEFAULT_FILE_MODE & ~current_umask()
    folder, name = os.path.split(real)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # mkstemp makes 0600; the user's umask decides, as for any new file
        os.replace(tmp, real)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
