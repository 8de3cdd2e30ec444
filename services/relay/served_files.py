"""Which file, and which bytes of it, a request may have: URL path segments decoded without ever
traversing, files opened only when the open file itself lies inside the served folder (asked of the
kernel through its descriptor), and HTTP Range headers. Why each check is there: docs/relay.md, Security.

Stdlib only; knows nothing of checkpoints or HTTP handlers.
"""

import errno
import os
import re
import stat
import sys
from typing import BinaryIO
from urllib.parse import unquote

MAX_RANGE_DIGITS = 19  # 10**19 bytes is more than any file; longer numbers are refused before int()

# Opening never follows a link in the last component (the path was resolved just before), never
# waits on a FIFO and never makes a terminal ours; the descriptor is then checked (open_inside).
OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
              | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))


class InvalidPath(ValueError):
    """A URL path with a segment that is not a plain name (empty, '.', '..', or holding a separator or NUL)."""


class NotServable(Exception):
    """A file that may not be sent: not there, not a regular file, or not inside the served folder."""


class RangeNotSatisfiable(Exception):
    """A Range header that asks for bytes outside the file, or that does not parse (answered 416)."""


def decode_segments(raw: str) -> list[str]:
    """Split a raw URL path into percent-decoded segments; refuse anything that could traverse.

    Raises InvalidPath for a segment that is empty, '.', '..', or holds '/', '\\' or NUL once decoded
    (so `..`, `%2F` and `%2e%2e` never reach the filesystem), UnicodeDecodeError for bad percent-encoding."""
    segments = []
    for part in raw.split("/"):
        segment = unquote(part, errors="strict")
        if segment in ("", ".", "..") or "/" in segment or "\\" in segment or "\x00" in segment:
            raise InvalidPath("invalid path: segments must be plain names (no '..', separators or empty parts)")
        segments.append(segment)
    return segments


def is_inside(path: str, root: str) -> bool:
    """Whether the absolute, resolved `path` is `root` or lies under it (compared by components, not prefix)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def fd_path(fd: int) -> str:
    """Where the open file `fd` is now, as the kernel tracks it (not a path resolved by us).

    Linux: /proc/self/fd/N (a file deleted since it was opened reads '<path> (deleted)');
    macOS: fcntl F_GETPATH. Raises OSError where neither exists."""
    if sys.platform.startswith("linux"):
        return os.readlink(f"/proc/self/fd/{fd}")
    import fcntl

    if hasattr(fcntl, "F_GETPATH"):
        return os.fsdecode(fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).split(b"\0", 1)[0])
    raise OSError(errno.ENOSYS, f"cannot tell where an open file lives on {sys.platform}")


def open_inside(path: str | os.PathLike, roots: tuple[str, ...]) -> tuple[BinaryIO, os.stat_result]:
    """(open file, its fstat) for `path` if, once opened, it is a regular file inside one of `roots`;
    raises NotServable otherwise. What is checked is the opened file itself, so whatever a link or
    directory is swapped for meanwhile, the bytes read later are those of a file that was inside."""
    real = os.path.realpath(path)
    if not any(is_inside(real, root) for root in roots):  # don't even open what resolves outside
        raise NotServable(f"{path} resolves outside the served folder")
    try:
        fd = os.open(real, OPEN_FLAGS)
    except OSError as e:  # gone, unreadable, or its last component became a link (ELOOP)
        raise NotServable(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotServable(f"{path} is not a regular file")
        where = fd_path(fd)
        if where.endswith(" (deleted)") or not any(is_inside(where, root) for root in roots):
            raise NotServable(f"{path} is not inside the served folder")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0), st
    except BaseException:
        os.close(fd)
        raise


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime): equal for two stats of the same, unchanged file."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_RANGE_SPEC = re.compile(r"\s*(\d*)\s*-\s*(\d*)\s*")


def parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a Range header for a file of `size` bytes; None for the whole file.

    Another unit than bytes, or several ranges, are ignored (RFC 9110 lets a server send the whole
    file). Raises RangeNotSatisfiable (416) for a range outside the file, a `bytes=` value that
    does not parse, or a number of more than MAX_RANGE_DIGITS digits (never int() on it: Python
    refuses to convert 4,300+ digits, and no file is that large anyway)."""
    if value is None or not value.strip():
        return None
    unit, eq, specs = value.partition("=")
    if unit.strip().lower() != "bytes":
        return None
    parts = [_RANGE_SPEC.fullmatch(part) for part in specs.split(",")] if eq else [None]
    for match in parts:
        if (match is None or not (match.group(1) or match.group(2))
                or max(len(match.group(1)), len(match.group(2))) > MAX_RANGE_DIGITS):
            raise RangeNotSatisfiable()
    if len(parts) > 1:
        return None
    (match,) = parts
    assert match is not None  # every part matched: checked above
    first, last = match.group(1), match.group(2)
    if first:
        start = int(first)
        if start >= size or (last and int(last) < start):
            raise RangeNotSatisfiable()
        return start, min(int(last), size - 1) if last else size - 1
    n = int(last)  # suffix: the last n bytes
    if n == 0 or size == 0:
        raise RangeNotSatisfiable()
    return max(0, size - n), size - 1
