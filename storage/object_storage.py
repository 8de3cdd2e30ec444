"""The store on object storage: `s3://bucket/prefix` (AWS S3 or any S3-compatible server), through obstore.

Why obstore (rather than fsspec's s3fs): conditional writes are ordinary put modes (`mode="create"` sends
`If-None-Match: *`, an e_tag mode sends `If-Match`), and the store's locks are built on exactly those; it is
one self-contained wheel (s3fs pins aiobotocore and botocore); zarr 3.1 opens it as it is
(`zarr.storage.ObjectStore`) for the feature arrays; and its transfers run outside the GIL.

Configuration is AWS's own environment, read by obstore: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_REGION`, and for an S3-compatible server `AWS_ENDPOINT_URL` (plain `http://` also needs
`AWS_ALLOW_HTTP=true`).

Locks (`ObjectStorage.lease`): a lock is an object created with `If-None-Match: *`, so exactly one of any
number of machines creates it. It holds its owner and an expiry; the holder renews it (a conditional
`If-Match` rewrite) every LEASE_SECONDS / 4, so a holder that crashed or lost its network stops renewing
and the lock expires: the next process takes it over with an `If-Match` rewrite of the expired object
(two that try at once: one wins). Expiry is judged on the waiting machine's clock against the holder's:
clocks need to agree to well within LEASE_SECONDS (NTP does).
"""

import hashlib
import json
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import obstore
from obstore.store import S3Store

from .records import PARTIAL_SUFFIX

if TYPE_CHECKING:  # obstore's TypedDicts exist in its stubs only
    import zarr.storage
    from obstore import ObjectMeta, PutMode

SCHEMES = ("s3",)
LEASE_SECONDS = 60.0  # how long a lock outlives its holder's last renewal
STREAM_BYTES = 8 << 20

_URL_RE = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)")


class ObjectStorageError(OSError):
    """Object storage could not be used (unreachable, no such bucket, refused credentials): one line
    saying what failed and what to check."""


class LockLost(RuntimeError):
    """A lock's lease expired while held (its holder stalled longer than the lease) and another process
    took it over: this one must not commit."""


class LockBusy(TimeoutError):
    """A lock is held by another process (named in the message) and did not come free in time."""


def store_url(location: str) -> tuple[str, str, str] | None:
    """(scheme, bucket, prefix) of an object-storage URL; None for a local path (or a `file://` URL).
    Raises ValueError for a URL of another scheme, or without a bucket."""
    match = _URL_RE.fullmatch(str(location))
    if match is None or match.group(1).lower() == "file":
        return None
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in SCHEMES:
        raise ValueError(f"store {location!r}: {scheme}:// is not supported; give a local folder or "
                         "s3://BUCKET/PREFIX (AWS S3 or an S3-compatible server at $AWS_ENDPOINT_URL)")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"store {location!r} names no bucket: give s3://BUCKET/PREFIX")
    return scheme, bucket, prefix.strip("/")


def local_path(location: str) -> Path:
    """The folder a local store location names (a path, or a `file://` URL)."""
    match = _URL_RE.fullmatch(str(location))
    return Path(match.group(2)) if match else Path(location)


@dataclass(frozen=True)
class Lease:
    """A lock held on object storage: renewed in the background until released."""

    storage: "ObjectStorage"
    key: str
    owner: str
    lost: threading.Event

    def check(self) -> None:
        """Raise LockLost if another process took the lock over since it was taken: asks the server (a holder
        that stalled has not renewed, so its renewer has not noticed yet)."""
        try:
            raw, _ = self.storage.get(self.key)
            held = _parse_lock(raw)["owner"] == self.owner
        except FileNotFoundError:
            held = False
        if self.lost.is_set() or not held:
            self.lost.set()
            raise LockLost(f"the lock {self.key} expired while this process held it (it stalled for longer than "
                           f"the {LEASE_SECONDS:.0f} s lease) and another process took it over: nothing was "
                           "committed; run again")


class ObjectStorage:
    """One bucket and prefix of object storage, with what the store needs of it: whole-object reads and
    writes, conditional writes, listing, deletion, streaming to and from files, and lease locks. Keys are
    relative to the prefix."""

    def __init__(self, url: str, *, lease_seconds: float = LEASE_SECONDS):
        parsed = store_url(url)
        if parsed is None:
            raise ValueError(f"not an object-storage URL: {url!r}")
        _, self.bucket, self.prefix = parsed
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.lease_seconds = lease_seconds
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        self._store = self._open(self.prefix)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def _open(self, prefix: str) -> S3Store:
        # client_options replace the ones obstore reads from the environment: keep AWS_ALLOW_HTTP
        return S3Store(self.bucket, prefix=prefix or None,
                       client_options={"connect_timeout": "5s", "timeout": "300s", "allow_http": _http_allowed()},
                       retry_config={"max_retries": 3, "retry_timeout": timedelta(seconds=20)})

    def child(self, relative: str) -> "ObjectStorage":
        """The same bucket under `<prefix>/<relative>`."""
        return ObjectStorage(f"{self.url}/{relative.strip('/')}", lease_seconds=self.lease_seconds)

    def zarr_store(self) -> "zarr.storage.ObjectStore[S3Store]":
        """A zarr store over this prefix (zarr.storage.ObjectStore)."""
        import zarr.storage

        return zarr.storage.ObjectStore(self._store)

    # ------------------------------------------------------------ objects

    def get(self, key: str) -> tuple[bytes, str]:
        """(content, e_tag) of object `key`; FileNotFoundError when there is none."""
        with self._errors(key):
            result = obstore.get(self._store, key)
            return bytes(result.bytes()), self._e_tag(key, result.meta["e_tag"])

    def head(self, key: str) -> "ObjectMeta | None":
        """{"size", "e_tag", ...} of object `key`, None when there is none."""
        try:
            with self._errors(key):
                return obstore.head(self._store, key)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None) -> str:
        """Write object `key` whole (one PUT: readers see the old object or the new one); returns its e_tag.
        create: only if there is none (FileExistsError otherwise); if_match: only if it still has that e_tag
        (FileExistsError otherwise)."""
        mode: PutMode = "create" if create else {"e_tag": if_match} if if_match else "overwrite"
        try:
            with self._errors(key):
                return self._e_tag(key, obstore.put(self._store, key, data, mode=mode)["e_tag"])
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError) as e:
            raise FileExistsError(f"{self.url}/{key}: {_first_line(e)}") from None

    def upload(self, key: str, path: Path) -> None:
        """Stream the file at `path` to object `key` (multipart for large files; the object appears whole)."""
        with self._errors(key):
            obstore.put(self._store, key, Path(path))

    def download(self, key: str, path: Path) -> tuple[int, str]:
        """Stream object `key` into the file at `path` (replaced atomically); returns (size, sha256), hashed
        while it streams. FileNotFoundError when there is no such object."""
        path.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f, self._errors(key):
                for chunk in obstore.get(self._store, key).stream(min_chunk_size=STREAM_BYTES):
                    view = memoryview(chunk)
                    digest.update(view)
                    f.write(view)
                    size += len(view)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return size, digest.hexdigest()

    def objects(self, prefix: str = "") -> "list[ObjectMeta]":
        """Every object under `prefix` (recursively), which matches whole path segments ("a/b" lists "a/b/c",
        never "a/bc"): [{"path" (relative to this storage's prefix), "size", "e_tag", ...}]."""
        with self._errors(prefix or "/"):
            return [meta for batch in obstore.list(self._store, prefix=prefix or None, chunk_size=1000)
                    for meta in batch]

    def delete(self, keys: list[str]) -> None:
        """Delete objects (absent ones are no error)."""
        if keys:
            with self._errors(keys[0]):
                obstore.delete(self._store, keys)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix/`."""
        self.delete([meta["path"] for meta in self.objects(prefix.rstrip("/") + "/")])

    def check_reachable(self) -> None:
        """ObjectStorageError unless the bucket can be listed (server up, bucket there, credentials taken)."""
        with self._errors(""):
            next(iter(obstore.list(self._store, chunk_size=1)), None)

    # ------------------------------------------------------------ locks

    @contextmanager
    def lease(self, key: str, timeout: float | None = None) -> Iterator[Lease]:
        """Hold the lock object `key` for the `with` block (module docstring): waits for a live holder,
        takes over an expired one, renews in the background, deletes it at the end. Raises LockBusy after
        `timeout` seconds (None: waits forever)."""
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        e_tag = self._acquire(key, owner, timeout)
        lease = Lease(self, key, owner, threading.Event())
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(key, owner, e_tag, stop, lease.lost), daemon=True,
                                   name=f"lease {key}")
        renewer.start()
        try:
            yield lease
        finally:
            stop.set()
            renewer.join()
            if not lease.lost.is_set():
                self._release(key, owner)

    def _lock_body(self, owner: str) -> bytes:
        return json.dumps({"owner": owner, "expires": time.time() + self.lease_seconds}).encode()

    def _acquire(self, key: str, owner: str, timeout: float | None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            try:
                return self.put(key, self._lock_body(owner), create=True)
            except FileExistsError:
                pass
            try:
                raw, e_tag = self.get(key)
            except FileNotFoundError:
                continue  # released meanwhile: try again at once
            holder = _parse_lock(raw)
            if holder["expires"] < time.time():
                try:  # take over the expired lock; of several that try, the first rewrite wins
                    return self.put(key, self._lock_body(owner), if_match=e_tag)
                except FileExistsError:
                    continue
            if deadline is not None and time.monotonic() >= deadline:
                left = holder["expires"] - time.time()
                raise LockBusy(f"{self.url}/{key} is held by {holder['owner']} (its lease runs {left:.0f} s more "
                               f"unless renewed); waited {timeout} s")
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    def _renew(self, key: str, owner: str, e_tag: str, stop: threading.Event, lost: threading.Event) -> None:
        while not stop.wait(self.lease_seconds / 4):
            try:
                e_tag = self.put(key, self._lock_body(owner), if_match=e_tag)
            except FileExistsError:  # rewritten by another: it took over an expired lease
                lost.set()
                return
            except OSError:
                pass  # a network blip: the next renewal tries again, well before the lease ends

    def _release(self, key: str, owner: str) -> None:
        # Delete only our own lock. (S3 has no conditional delete for every server: between this read and the
        # delete the lock could only change hands if our lease expired, and the renewer keeps it alive.)
        try:
            raw, _ = self.get(key)
        except FileNotFoundError:
            return
        if _parse_lock(raw)["owner"] == owner:
            self.delete([key])

    # ------------------------------------------------------------ errors

    def _e_tag(self, key: str, e_tag: str | None) -> str:
        # S3 answers every read and write with an ETag; the store's locks and markers rely on it
        if e_tag is None:
            raise ObjectStorageError(f"object storage {self.url} gave no ETag for {key}: the store needs a server "
                                     "that does (conditional writes compare them)")
        return e_tag

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        # obstore's messages run to dozens of lines of debug detail: one line, and what to check
        try:
            yield
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{key}: no such object") from None
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
            raise
        except obstore.exceptions.BaseError as e:
            where = f" at {self.endpoint}" if self.endpoint else ""
            if (self.endpoint or "").lower().startswith("http://") and not _http_allowed():
                raise ObjectStorageError(
                    f"object storage {self.url}{where}: the endpoint is plain http://, which is refused unless "
                    "AWS_ALLOW_HTTP=true is set (do so for a server on a trusted network, or use https://)") from None
            raise ObjectStorageError(
                f"object storage {self.url}{where} failed on {key or 'a listing'}: {_first_line(e)}. Check that the server is up "
                "(AWS_ENDPOINT_URL), the bucket exists and the credentials (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY) are accepted") from None


def _parse_lock(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
        return {"owner": str(data["owner"]), "expires": float(data["expires"])}
    except (ValueError, KeyError, TypeError):
        return {"owner": "unknown (unreadable lock object)", "expires": 0.0}  # unreadable: expired


def _http_allowed() -> bool:
    return os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
