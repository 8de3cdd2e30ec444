"""A relay started with `upstream=` serves checkpoints it does not hold by pulling each file through from
the upstream relay once, into its cache (`state_dir/cache/<path>/<name>`), serving it while it arrives."""

import io
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .client import RelayClient
from .served_files import NotServable

log = logging.getLogger(__name__)


class UpstreamPull:
    """One file being downloaded from the upstream into the cache, served while it arrives.

    Clients get the bytes as they land in `cache/<path>/.partial/<name>` instead of waiting for
    the whole (17 GB) file: they verify the sha256 themselves. The cached file is only used as a
    finished file once verified (RelayClient.download_file renames it into place then), and is
    recorded in `verified` (cache file -> (size, mtime_ns, sha256)) when it is.
    `open_cache_file` opens a file of the cache as any file sent is opened: checked, through its
    descriptor, to lie inside the cache (raises NotServable otherwise).
    """

    def __init__(self, upstream: RelayClient, path: str, entry: dict, cache_dir: Path,
                 open_cache_file: Callable[[Path], tuple[BinaryIO, os.stat_result]],
                 verified: dict[str, tuple[int, int, str]]):
        self.upstream, self.path, self.entry, self.cache_dir = upstream, path, entry, cache_dir
        self._open_cache_file = open_cache_file
        self._verified = verified
        self.final = cache_dir / entry["name"]
        self.partial = cache_dir / ".partial" / entry["name"]
        self.done = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"relay-pull {path}/{entry['name']}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        log.info("pulling %s/%s (%d bytes) from upstream %s", self.path, self.entry["name"], self.entry["size"], self.upstream.base_url)
        try:
            self.upstream.download_file(self.path, self.entry, self.cache_dir)
            st = self.final.stat()
            self._verified[str(self.final)] = (st.st_size, st.st_mtime_ns, self.entry["sha256"])
        except Exception as e:  # reported to the clients waiting on it
            self.error = str(e) or type(e).__name__
            log.warning("pulling %s/%s from upstream failed: %s", self.path, self.entry["name"], self.error)
        finally:
            self.done.set()

    def wait_started(self, timeout: float = 600) -> bool:
        """Wait until bytes can be served (the partial file exists or the pull ended); False if it failed."""
        deadline = time.monotonic() + timeout
        while not self.done.wait(0.02):
            if self.partial.exists() or time.monotonic() > deadline:
                return True
        return self.error is None

    def open(self) -> tuple[BinaryIO, Callable[[], bool]]:
        """(file object, more): read the file as it grows; `more()` waits and says whether to read again.
        The file is opened as any file sent is: checked, through its descriptor, to lie in the cache."""
        while True:
            for candidate in (self.final, self.partial) if self.done.is_set() else (self.partial, self.final):
                try:
                    f, _ = self._open_cache_file(candidate)
                    break
                except NotServable:
                    continue
            else:
                if self.done.wait(0.02) and not self.final.exists() and not self.partial.exists():
                    return io.BytesIO(b""), lambda: False  # failed before any byte: a short body
                continue
            break
        last_read = [False]

        def more() -> bool:
            if self.done.is_set():
                # One more read after the end: bytes written just before it are not missed.
                if last_read[0]:
                    return False
                last_read[0] = True
                return True
            self.done.wait(0.05)
            return True

        return f, more
