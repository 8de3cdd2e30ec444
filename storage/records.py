"""Small JSON records (manifests, references, drafts, scores) written atomically.

A reader must never see half a record: every write goes to a temporary file in
the same directory, is flushed to disk, and is renamed over the target with
`os.replace` (atomic on POSIX within one filesystem). A writer killed at any
point leaves either the old file or the new one, plus at worst a stray
`*.partial` file that nothing reads.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same directory, fsync, `os.replace`).

    The parent directory is created if needed. On any error the temporary file is removed
    and the previous content of `path`, if any, is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory as the target: os.replace is only atomic within one filesystem.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            # Without fsync a power loss can leave the renamed file empty (rename is journaled
            # before the data on ext4/xfs). A killed process alone would not need it; it is cheap
            # for files this small.
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable. Best effort: some filesystems refuse fsync on directories.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int | None = None) -> None:
    """Serialize `obj` as JSON (sorted keys, UTF-8) and write it to `path` atomically.

    NaN and infinities are refused (`ValueError`): they are not JSON, and other readers
    (the Prefect UI, `jq`) reject them. Map them to `None` before writing.
    """
    text = json.dumps(obj, sort_keys=True, indent=indent, ensure_ascii=False, allow_nan=False)
    write_bytes_atomic(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file written by `write_json_atomic`.

    Raises `FileNotFoundError` when absent and `json.JSONDecodeError` (a `ValueError`) when
    the content is not valid JSON; callers decide whether that is a miss.
    """
    with open(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"))
