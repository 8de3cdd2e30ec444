"""Client of the checkpoint relay (protocol v1: docs/relay.md, Protocol; the server: `services/relay/server.py`).

    client = RelayClient("http://relay:8470", token=token)
    client.list_checkpoints()                  # [{"path", "step", "total_bytes", "n_files"}, ...]
    client.manifest("run1/step_1000")          # {"path", "step", "total_bytes", "files": [...], "key"}
    client.download("run1/step_1000", dest)    # every file verified into dest/, returns the manifest

`download` writes each file to `dest/.partial/<name>`, resumes an existing partial file with a
Range request (a resume refused with 416 starts the file over), verifies its sha256 and only then
renames it to `dest/<name>`: `dest/<name>` is always a complete, verified file. Every request is
retried by urllib3's `Retry` on the session (connection errors, timeouts, 5xx answers, a busy relay's
503 after its Retry-After); a download cut mid-file is resumed from where it stopped, up to `retries`
times. A killed or failed download is resumed by running it again.
The caller moves the finished directory into place (the `.partial/` folder is empty then).

Imports neither Prefect nor dflash_core.
"""

import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import requests
import urllib3

from dflash_eval.services.http_session import retrying_session
from dflash_eval.storage.hashing import file_sha256, key_of

API = "/v1"
PARTIAL_DIRNAME = ".partial"
CHUNK_BYTES = 4 << 20  # per read: fewer, larger sha256 updates and writes (measured 12% less CPU than 1 MiB)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class RelayError(Exception):
    """Anything that went wrong talking to a relay; the message says what and what to do.

    `status`: the relay's HTTP status when it answered with an error (401, 404, 409, ...), else None;
    `detail`: the relay's own error text; `headers`: headers worth passing on (Retry-After).
    """

    def __init__(self, message: str, status: int | None = None, detail: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.headers = headers or {}


def parse_checkpoint_url(url: str) -> tuple[str, str]:
    """`http(s)://host:port/run1/step_1000` -> (`http(s)://host:port`, `run1/step_1000`).

    A checkpoint's URL is its relay's base URL followed by its relay path.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RelayError(f"not a relay checkpoint URL: {url!r} (expected http(s)://HOST:PORT/RUN/STEP)")
    if parts.query or parts.fragment:
        raise RelayError(f"a relay checkpoint URL has no query or fragment: {url!r}")
    path = parts.path.strip("/")
    if not path:
        raise RelayError(f"{url!r} names a relay but no checkpoint; `dflash-eval relay ls {url}` lists them")
    _check_relay_path(path)
    return f"{parts.scheme}://{parts.netloc}", path


def _check_relay_path(path: str) -> list[str]:
    segments = path.strip("/").split("/")
    for segment in segments:
        if segment in ("", ".", "..") or "\\" in segment or "\x00" in segment:
            raise RelayError(f"invalid checkpoint path {path!r}: segments must be plain folder names")
    return segments


def check_file_name(name: Any) -> str | None:
    """Why `name` is not an acceptable checkpoint file name, or None when it is."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if "/" in name or "\\" in name or "\x00" in name:
        return "contains a path separator or NUL"
    if name.startswith("."):
        return "starts with '.' (hidden files, '.' and '..' are never served)"
    return None


def validate_manifest(manifest: Any, source: str) -> dict:
    """Check a manifest received from the network before anything is written; raise RelayError if bad."""

    def bad(why: str) -> RelayError:
        return RelayError(f"malformed manifest from {source}: {why}; refusing to download anything")

    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise bad("expected a JSON object with a 'files' list")
    seen: set[str] = set()
    for i, entry in enumerate(manifest["files"]):
        if not isinstance(entry, dict):
            raise bad(f"files[{i}] is not an object")
        name: Any = entry.get("name")  # untrusted JSON until check_file_name accepts it
        why = check_file_name(name)
        if why:
            raise bad(f"files[{i}].name {name!r} {why}")
        if name in seen:
            raise bad(f"duplicate file name {name!r}")
        seen.add(name)
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"files[{i}].size {size!r} is not a non-negative integer")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not _SHA256_RE.match(sha):
            raise bad(f"files[{i}].sha256 {sha!r} is not 64 lowercase hex digits")
    key = key_of({"files": {e["name"]: e["sha256"] for e in manifest["files"]}})
    if "key" in manifest and manifest["key"] != key:
        raise bad(f"key {manifest['key']!r} does not match its files (expected {key})")
    manifest = dict(manifest)
    manifest["key"] = key
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"])
    return manifest


class _Resume(Exception):
    """A download that stopped short of its file (a cut connection, a short body, a refused resume):
    ask again from where it stopped."""


class RelayClient:
    """Talks to one relay. Thread-safe; `download` uses `parallel` threads.

    timeout: seconds to connect and between received bytes. The manifest request may wait longer
    (`manifest_timeout`): a relay hashes a checkpoint once, on its first manifest request.
    retries: attempts after the first, per request (urllib3's `Retry`: connection errors, timeouts,
    5xx) and per file for resuming a cut download; a resume attempt that moved at least
    `PROGRESS_RESETS_RETRIES` bytes resets the count (a long transfer over a flaky link goes on).
    backoff: seconds; urllib3's backoff factor for requests (the first retry at once, the second after
    2 * backoff, each next one after twice as long; a Retry-After instead where the relay sends one),
    and the wait before the first resume of a download, doubled after each.
    """

    PROGRESS_RESETS_RETRIES = 64 << 20

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 60,
        retries: int = 4,
        backoff: float = 0.5,
        manifest_timeout: float = 1800,
    ):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RelayError(f"not a relay URL: {base_url!r} (expected http(s)://HOST:PORT)")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.manifest_timeout = max(timeout, manifest_timeout)
        # up to 32 connections kept for reuse: the threads of parallel downloads, a middle relay's pulls
        self._session = retrying_session(retries, backoff, methods=frozenset({"GET"}), pool_maxsize=32,
                                         bearer_token=token)

    def close(self) -> None:
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ requests

    def _url(self, kind: str, path: str, name: str | None = None) -> str:
        segments = _check_relay_path(path) + ([name] if name is not None else [])
        return f"{self.base_url}{API}/{kind}/" + "/".join(quote(s, safe="") for s in segments)

    def _raise_for(self, response: requests.Response, what: str, path: str | None) -> None:
        status = response.status_code
        if status < 400:
            return
        try:
            detail = str(response.json().get("error", ""))
        except (ValueError, AttributeError):
            detail = response.text[:200]
        if status == 401:
            raise RelayError(f"{what}: the relay {self.base_url} refused the token: check --token-file", status)
        if status == 404 and path is not None:
            raise RelayError(
                f"{what}: no checkpoint {path} on {self.base_url} ({detail}); "
                f"`dflash-eval relay ls {self.base_url}` lists them",
                status, detail,
            )
        if status == 409:  # the checkpoint exists but is still being written: worth waiting for
            retry_after = response.headers.get("Retry-After")
            raise RelayError(f"{what}: {detail}", status, detail, {"Retry-After": retry_after} if retry_after else None)
        if status >= 500:  # what the session's retries left
            raise RelayError(f"{what}: HTTP {status} from {self.base_url} after {self.retries + 1} attempts: {detail}",
                             status, detail)
        raise RelayError(f"{what}: HTTP {status} from {self.base_url}: {detail}", status, detail)

    def _get(self, url: str, what: str, path: str | None, timeout: float) -> requests.Response:
        """GET `url` (the session retries connection errors, timeouts and 5xx); RelayError when it
        fails all the same or the relay refuses."""
        try:
            response = self._session.get(url, timeout=(self.timeout, timeout))
        except (requests.ConnectionError, requests.Timeout) as e:
            raise RelayError(f"{what}: {self.base_url} unreachable after {self.retries + 1} attempts ({e}); "
                             "check that the relay runs and the URL") from e
        self._raise_for(response, what, path)
        return response

    def _get_json(self, url: str, what: str, path: str | None, timeout: float) -> Any:
        response = self._get(url, what, path, timeout)
        try:
            return response.json()
        except ValueError as e:
            raise RelayError(f"{what}: {self.base_url} answered with something that is not JSON ({e})") from e

    def list_checkpoints(self) -> list[dict]:
        """The relay's settled checkpoints: [{"path", "step", "total_bytes", "n_files"}], sorted by path."""
        data = self._get_json(f"{self.base_url}{API}/checkpoints", "listing checkpoints", None, self.timeout)
        if not isinstance(data, dict) or not isinstance(data.get("checkpoints"), list):
            raise RelayError(f"listing checkpoints: unexpected answer from {self.base_url}: {str(data)[:200]}")
        return data["checkpoints"]

    def manifest(self, path: str, include: Iterable[str] = ()) -> dict:
        """The validated manifest of checkpoint `path`: the files evaluation needs, plus those matching
        the `include` patterns (RelayError if the relay sends a malformed one). Its "path" is the
        checkpoint's own path (it differs from `path` when that names a link such as run1-latest)."""
        url = self._url("manifest", path)
        include = list(include)
        if include:
            url += "?" + urlencode([("include", pattern) for pattern in include])
        data = self._get_json(url, f"manifest of {path}", path, self.manifest_timeout)
        manifest = validate_manifest(data, f"{self.base_url} for {path}")
        if not isinstance(manifest.get("path"), str):
            manifest["path"] = path
        _check_relay_path(manifest["path"])
        return manifest

    def read_small_file(self, path: str, name: str, max_bytes: int = 16 << 20, manifest: dict | None = None) -> bytes:
        """The bytes of one small file of a checkpoint (e.g. config.json, to check it before any
        download), verified against the manifest's sha256."""
        manifest = manifest or self.manifest(path)
        entry = next((f for f in manifest["files"] if f["name"] == name), None)
        if entry is None:
            raise RelayError(f"checkpoint {path} on {self.base_url} has no {name}")
        if entry["size"] > max_bytes:
            raise RelayError(f"{name} of {path} is {entry['size']} bytes, more than {max_bytes} to read into memory")
        response = self._get(self._url("files", manifest["path"], name), f"reading {name} of {path}", path, self.timeout)
        if hashlib.sha256(response.content).hexdigest() != entry["sha256"]:
            raise RelayError(f"{name} of {path} from {self.base_url} does not match its manifest sha256")
        return response.content

    # ------------------------------------------------------------ downloads

    def download(
        self,
        path: str,
        destination_dir: str | os.PathLike,
        parallel: int = 4,
        progress: Callable[[int, int], None] | None = None,
        manifest: dict | None = None,
    ) -> dict:
        """Download every file of the manifest of checkpoint `path` into `destination_dir`, verified;
        return the manifest.

        manifest: one already read (e.g. with include patterns); its "path" is downloaded.
        Resumes partial files in `destination_dir/.partial/`, skips files already there and
        verified, retries transient failures. `progress(bytes_done, bytes_total)` is called as
        bytes arrive (from the download threads, one call at a time).
        """
        manifest = manifest or self.manifest(path)  # validated before anything is written
        path = manifest["path"]
        destination = Path(destination_dir)
        total = manifest["total_bytes"]
        lock = threading.Lock()
        done = [0]

        def advance(n: int) -> None:
            with lock:
                done[0] += n
                if progress is not None:
                    progress(done[0], total)

        files = sorted(manifest["files"], key=lambda e: -e["size"])  # largest first: shortest wall time
        if progress is not None:
            progress(0, total)
        with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="relay-download") as pool:
            futures = [pool.submit(self.download_file, path, entry, destination, advance) for entry in files]
            errors = []
            for future in futures:
                try:
                    future.result()
                except Exception as e:  # noqa: BLE001 - collected, first one re-raised
                    errors.append(e)
        if errors:
            if len(errors) > 1 and isinstance(errors[0], RelayError):
                raise RelayError(f"{errors[0]} (and {len(errors) - 1} more failed files)") from errors[0]
            raise errors[0]
        try:
            (destination / PARTIAL_DIRNAME).rmdir()
        except OSError:
            pass
        return manifest

    def download_file(
        self,
        path: str,
        entry: dict,
        destination_dir: str | os.PathLike,
        advance: Callable[[int], None] | None = None,
    ) -> Path:
        """Fetch one manifest entry into `destination_dir/<name>` (verified), resuming its partial file."""
        advance = advance or (lambda n: None)
        name, size, sha = entry["name"], entry["size"], entry["sha256"]
        if check_file_name(name):
            raise RelayError(f"refusing file name {name!r} from {self.base_url}")
        destination = Path(destination_dir)
        final = destination / name
        partial = destination / PARTIAL_DIRNAME / name
        try:
            if final.stat().st_size == size and file_sha256(final) == sha:
                advance(size)
                return final
        except FileNotFoundError:
            pass
        partial.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # a digest mismatch is fetched once more, from scratch
            if self._fetch_partial(path, name, size, partial, advance) == sha:
                os.replace(partial, final)
                return final
            partial.unlink()
            advance(-size)
        raise RelayError(
            f"{name} of {path} from {self.base_url} failed sha256 verification twice; "
            "the file changes on the relay's side or the link corrupts data; check the source checkpoint"
        )

    def _fetch_partial(self, path: str, name: str, size: int, partial: Path, advance: Callable[[int], None]) -> str:
        """Bring `partial` to `size` bytes from the relay, resuming from its current length; return its
        sha256, computed as the bytes arrive (a second pass over the file would double the disk reads)."""
        url = self._url("files", path, name)
        counted = 0  # bytes of this file reported through `advance`
        hasher, hashed = hashlib.sha256(), 0  # digest of the first `hashed` bytes of `partial`

        def hash_up_to(have: int) -> None:
            nonlocal hasher, hashed
            if hashed != have:  # resumed from bytes this call did not receive: hash them from disk
                hasher, hashed = hashlib.sha256(), 0
                if not have:  # starting over (a 200 after a 416): the partial file may be gone
                    return
                with open(partial, "rb") as f:
                    while hashed < have:
                        block = f.read(min(1 << 20, have - hashed))
                        hasher.update(block)
                        hashed += len(block)

        def on_disk() -> int:
            nonlocal counted
            try:
                have = partial.stat().st_size
            except FileNotFoundError:
                have = 0
            if have > size:  # not a prefix of this file: start over
                partial.unlink()
                have = 0
            advance(have - counted)
            counted = have
            return have

        failures = 0
        have = on_disk()
        if have == size and partial.exists():
            hash_up_to(have)
            return hasher.hexdigest()
        what = f"downloading {name} of {path}"
        while have < size or not partial.exists():
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                r = self._session.get(url, headers=headers, stream=True, timeout=(self.timeout, self.timeout))
            except (requests.ConnectionError, requests.Timeout) as e:  # after the session's retries
                raise self._download_failed(what, self.retries + 1, e, have, partial) from e
            moved = 0
            try:
                with r:
                    if r.status_code == 416:
                        # The relay's file is shorter than the partial one: start again from scratch.
                        partial.unlink(missing_ok=True)
                        raise _Resume(f"{name}: the relay refused to resume at byte {have}; starting over")
                    self._raise_for(r, what, path)
                    if have and r.status_code == 206:
                        start = _content_range_start(r.headers.get("Content-Range"))
                        if start != have:
                            raise _Resume(f"{name}: asked to resume at byte {have}, got {r.headers.get('Content-Range')!r}")
                        mode = "ab"
                    else:  # 200: the whole file (also from a relay that ignores Range)
                        mode = "wb"
                        advance(-counted)
                        counted = have = 0
                    hash_up_to(have)
                    with open(partial, mode) as f:
                        for chunk in _body_chunks(r):
                            if have + len(chunk) > size:
                                raise _Resume(f"{name}: the relay sent more than the manifest's {size} bytes")
                            f.write(chunk)
                            hasher.update(chunk)
                            hashed += len(chunk)
                            have += len(chunk)
                            moved += len(chunk)
                            counted += len(chunk)
                            advance(len(chunk))
                    if have < size:
                        raise _Resume(f"{name}: connection ended at byte {have} of {size}")
                    return hasher.hexdigest()
            # the body, cut: requests' and urllib3's errors while reading it, or a short one
            except (requests.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, _Resume) as e:
                if moved >= self.PROGRESS_RESETS_RETRIES:
                    failures = 0
                failures += 1
                have = on_disk()
                if failures > self.retries:
                    raise self._download_failed(what, failures, e, have, partial) from e
                self._sleep(failures)
        hash_up_to(have)  # a cut download that had, after all, received the whole file
        return hasher.hexdigest()

    def _sleep(self, failures: int) -> None:
        """The wait before resuming a cut download for the `failures`-th time."""
        time.sleep(self.backoff * (2 ** (failures - 1)))

    def _download_failed(self, what: str, attempts: int, error: Exception, have: int, partial: Path) -> RelayError:
        return RelayError(f"{what} from {self.base_url} failed {attempts} times ({error}); the {have} bytes "
                          f"received are kept in {partial} and resumed by running it again")

def _body_chunks(response: requests.Response):
    """The body as it arrives. `read1` hands over every byte received before a connection drops
    (urllib3's `read(amt)`, under `iter_content`, discards a short last chunk on an early close);
    older urllib3 without `read1` falls back to small chunks, losing at most one on a cut."""
    read1 = getattr(response.raw, "read1", None)
    if read1 is not None:
        try:
            data = read1(CHUNK_BYTES)
        except (NotImplementedError, AttributeError):
            read1 = None
        else:
            while data:
                yield data
                data = read1(CHUNK_BYTES)
            return
    yield from response.iter_content(64 << 10)


def _content_range_start(value: str | None) -> int | None:
    match = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", (value or "").strip())
    return int(match.group(1)) if match else None


__all__ = ["RelayClient", "RelayError", "check_file_name", "parse_checkpoint_url", "validate_manifest"]
