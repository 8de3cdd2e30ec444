"""Checkpoint relay: real servers on loopback, small random checkpoints, injected faults."""

import http.client
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from dflash_eval.services.relay.client import RelayClient, RelayError, parse_checkpoint_url
from dflash_eval.services.relay.server import RelayServer
from dflash_eval.storage.hashing import directory_digest, file_sha256
from tests.checkpoints import settle, write_checkpoint

MB = 1 << 20


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "runs"
    write_checkpoint(root / "run1" / "step_1000", {"model.safetensors": 3 * MB + 17})
    write_checkpoint(
        root / "run1" / "step_2000",
        {"model-00001-of-00002.safetensors": 2 * MB, "model-00002-of-00002.safetensors": MB + 5},
    )
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (root / "run1" / "step_2000" / "model.safetensors.index.json").write_text(json.dumps(index))
    settle(root / "run1" / "step_2000")
    write_checkpoint(root / "run2" / "final", {"model.safetensors": 1000}, config={"step": 77})
    write_checkpoint(root / "run2" / "nostep", {"model.safetensors": 100})
    (root / "run2" / "notes").mkdir()  # not a checkpoint: no config.json / safetensors
    (root / "run2" / "notes" / "a.txt").write_text("x")
    return root


@pytest.fixture
def relay(tree, tmp_path):
    with RelayServer(tree, state_dir=tmp_path / "state", settle_seconds=5) as server:
        yield server


def get(relay, path, source="127.0.0.1", **headers):
    """A raw request, so the path reaches the server exactly as written (requests normalizes '..'), from
    the loopback address `source` (the relay bounds connections per client address)."""
    host, port = relay.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_listing_steps_sizes_and_settling(tree, relay):
    listed = RelayClient(relay.url).list_checkpoints()
    assert [c["path"] for c in listed] == ["run1/step_1000", "run1/step_2000", "run2/final", "run2/nostep"]
    by_path = {c["path"]: c for c in listed}
    assert by_path["run1/step_1000"]["step"] == 1000
    assert by_path["run2/final"]["step"] == 77  # from config.json
    assert by_path["run2/nostep"]["step"] is None
    step_2000 = tree / "run1" / "step_2000"
    assert by_path["run1/step_2000"]["n_files"] == 4
    assert by_path["run1/step_2000"]["total_bytes"] == sum(p.stat().st_size for p in step_2000.iterdir())

    # Being written: fresh files are not listed until settled; an index naming a missing shard neither.
    fresh = write_checkpoint(tree / "run1" / "checkpoint-3000", {"model.safetensors": 100}, age=0)
    assert "run1/checkpoint-3000" not in [c["path"] for c in RelayClient(relay.url).list_checkpoints()]
    status, headers, body = get(relay, "/v1/manifest/run1/checkpoint-3000")  # there, but not finished
    assert status == 409 and int(headers["Retry-After"]) >= 1 and b"still being written" in body
    assert get(relay, "/v1/files/run1/checkpoint-3000/model.safetensors")[0] == 409
    assert get(relay, "/v1/manifest/run1/checkpoint-4000")[0] == 404  # not there at all
    settle(fresh)
    listed = {c["path"]: c for c in RelayClient(relay.url).list_checkpoints()}
    assert listed["run1/checkpoint-3000"]["step"] == 3000
    (fresh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-2.safetensors"}}))
    settle(fresh)
    assert "run1/checkpoint-3000" not in [c["path"] for c in RelayClient(relay.url).list_checkpoints()]


def test_manifest_digests_and_key(tree, relay):
    client = RelayClient(relay.url)
    manifest = client.manifest("run1/step_2000")
    directory = tree / "run1" / "step_2000"
    assert manifest["path"] == "run1/step_2000" and manifest["step"] == 2000
    assert {f["name"]: f["sha256"] for f in manifest["files"]} == {p.name: file_sha256(p) for p in directory.iterdir()}
    assert {f["name"]: f["size"] for f in manifest["files"]} == {p.name: p.stat().st_size for p in directory.iterdir()}
    assert manifest["key"] == directory_digest(directory).key
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in directory.iterdir())
    misses = relay.digests.misses
    client.manifest("run1/step_2000")
    assert relay.digests.misses == misses  # digests computed once
    with pytest.raises(RelayError, match=r"no checkpoint run9/step_1 on .*relay ls"):
        client.manifest("run9/step_1")


def test_range_requests(tree, relay):
    data = (tree / "run2" / "final" / "model.safetensors").read_bytes()
    url = "/v1/files/run2/final/model.safetensors"
    status, headers, body = get(relay, url)
    assert status == 200 and body == data and headers["Content-Length"] == "1000"
    status, headers, body = get(relay, url, Range="bytes=100-")
    assert status == 206 and body == data[100:] and headers["Content-Range"] == "bytes 100-999/1000"
    assert headers["Content-Length"] == "900"
    status, headers, body = get(relay, url, Range="bytes=10-19")
    assert status == 206 and body == data[10:20] and headers["Content-Range"] == "bytes 10-19/1000"
    status, headers, body = get(relay, url, Range="bytes=-5")
    assert status == 206 and body == data[-5:]
    status, headers, _ = get(relay, url, Range="bytes=1000-")
    assert status == 416 and headers["Content-Range"] == "bytes */1000"
    assert get(relay, "/v1/files/run2/final/missing.bin")[0] == 404
    head = requests.head(relay.url + url, timeout=10)
    assert head.status_code == 200 and head.headers["Content-Length"] == "1000" and not head.content


def test_download_multi_file_with_progress(tree, relay, tmp_path):
    calls = []
    dest = tmp_path / "dest"
    manifest = RelayClient(relay.url).download(
        "run1/step_2000", dest, parallel=3, progress=lambda done, total: calls.append((done, total))
    )
    source = tree / "run1" / "step_2000"
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in source.iterdir())  # .partial removed
    for p in source.iterdir():
        assert (dest / p.name).read_bytes() == p.read_bytes()
    assert directory_digest(dest).key == manifest["key"]
    assert calls[-1] == (manifest["total_bytes"], manifest["total_bytes"])
    # Already there and verified: nothing is downloaded again.
    sent = relay.bytes_sent
    RelayClient(relay.url).download("run1/step_2000", dest)
    assert relay.bytes_sent == sent


@pytest.mark.slow  # starts processes or waits on purpose
def test_max_rate_caps_all_downloads_together(tree, tmp_path):
    """3 MB over two files in parallel at 6 MB/s total cannot finish in under half a second."""
    with RelayServer(tree, state_dir=tmp_path / "state", settle_seconds=5, max_rate=6 * MB) as capped:
        client = RelayClient(capped.url)
        key = client.manifest("run1/step_2000")["key"]
        started = time.monotonic()
        client.download("run1/step_2000", tmp_path / "dest", parallel=2)
        elapsed = time.monotonic() - started
    assert capped.bytes_sent >= 3 * MB
    assert elapsed >= capped.bytes_sent / (6 * MB)
    assert directory_digest(tmp_path / "dest").key == key


def test_cut_connection_resumes_without_redownloading(tree, relay, tmp_path):
    relay.faults.put("cut")
    dest = tmp_path / "dest"
    manifest = RelayClient(relay.url, backoff=0.05).download("run1/step_1000", dest)
    data = (tree / "run1" / "step_1000" / "model.safetensors").read_bytes()
    assert (dest / "model.safetensors").read_bytes() == data
    assert relay.faults.empty()
    # Half the weights came before the cut; the retry asked for the rest only.
    assert relay.bytes_sent < manifest["total_bytes"] + 64 * 1024
    assert relay.bytes_sent >= manifest["total_bytes"]


def test_existing_partial_file_is_resumed(tree, relay, tmp_path):
    data = (tree / "run1" / "step_1000" / "model.safetensors").read_bytes()
    dest = tmp_path / "dest"
    (dest / ".partial").mkdir(parents=True)
    (dest / ".partial" / "model.safetensors").write_bytes(data[: 2 * MB])
    RelayClient(relay.url).download("run1/step_1000", dest)
    assert (dest / "model.safetensors").read_bytes() == data
    assert relay.bytes_sent == len(data) - 2 * MB + (dest / "config.json").stat().st_size


def test_corrupted_byte_is_detected_and_refetched(tree, relay, tmp_path):
    relay.faults.put("corrupt")
    dest = tmp_path / "dest"
    manifest = RelayClient(relay.url, backoff=0.05).download("run2/final", dest, parallel=1)
    for p in (tree / "run2" / "final").iterdir():
        assert (dest / p.name).read_bytes() == p.read_bytes()
    assert relay.faults.empty()
    assert relay.bytes_sent == manifest["total_bytes"] + 1000  # the weights (largest, first) twice
    assert not (dest / ".partial").exists()


def test_truncated_file_never_lands_in_destination(tree, relay, tmp_path):
    dest = tmp_path / "dest"
    client = RelayClient(relay.url, retries=2, backoff=0.01)
    for fault in ["truncate", "cut", "truncate", "cut", "truncate", "cut"]:
        relay.faults.put(fault)
    with pytest.raises(RelayError, match="failed 3 times.*resumed by running it again"):
        client.download("run1/step_1000", dest, parallel=1)
    assert not (dest / "model.safetensors").exists()
    assert (dest / ".partial" / "model.safetensors").exists()
    # Faults gone: running it again finishes from the partial file.
    while not relay.faults.empty():
        relay.faults.get()
    client.download("run1/step_1000", dest)
    assert (dest / "model.safetensors").read_bytes() == (tree / "run1" / "step_1000" / "model.safetensors").read_bytes()


def test_upstream_chaining_serves_and_caches(tree, relay, tmp_path):
    with RelayServer(upstream=relay.url, state_dir=tmp_path / "middle", settle_seconds=5) as middle:
        client = RelayClient(middle.url)
        assert client.list_checkpoints() == RelayClient(relay.url).list_checkpoints()
        assert client.manifest("run1/step_2000") == RelayClient(relay.url).manifest("run1/step_2000")
        manifest = client.download("run1/step_2000", tmp_path / "a", parallel=2)
        for p in (tree / "run1" / "step_2000").iterdir():
            assert (tmp_path / "a" / p.name).read_bytes() == p.read_bytes()
        assert relay.bytes_sent == manifest["total_bytes"]
        client.download("run1/step_2000", tmp_path / "b", parallel=2)
        assert relay.bytes_sent == manifest["total_bytes"]  # served from the middle relay's cache
        assert middle.bytes_sent == 2 * manifest["total_bytes"]
        assert (tmp_path / "middle" / "cache" / "run1" / "step_2000" / "config.json").exists()
        with pytest.raises(RelayError, match="no checkpoint run1/nope"):
            client.manifest("run1/nope")
        # Checkpoint URL = relay base URL + relay path.
        assert parse_checkpoint_url(f"{middle.url}/run1/step_2000") == (middle.url, "run1/step_2000")


def test_path_traversal_refused(tree, relay, tmp_path):
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"top secret")
    outside = write_checkpoint(tmp_path / "outside_ckpt", {"model.safetensors": 100})
    # A symlinked file and a symlinked directory inside DIR pointing outside it.
    (tree / "run1" / "step_1000" / "leak.safetensors").symlink_to(secret)
    settle(tree / "run1" / "step_1000")
    (tree / "run1" / "linked").symlink_to(outside, target_is_directory=True)
    for path in [
        "/v1/files/../../etc/passwd",
        "/v1/files/run1/step_1000/../../../secret.safetensors",
        "/v1/files/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/v1/files/run1%2Fstep_1000/model.safetensors",
        "/v1/files/run1/step_1000/%2e%2e",
        "/v1/files//etc/passwd",
        "/v1/files/run1/step_1000/leak.safetensors",
        "/v1/files/run1/linked/model.safetensors",
        "/v1/manifest/run1/linked",
        "/v1/files/run1/step_1000/..%5c..%5csecret.safetensors",
        "/etc/passwd",
    ]:
        status, _, body = get(relay, path)
        assert status in (400, 404), path
        assert b"top secret" not in body
    manifest = RelayClient(relay.url).manifest("run1/step_1000")
    assert "leak.safetensors" not in [f["name"] for f in manifest["files"]]
    assert "run1/linked" not in [c["path"] for c in RelayClient(relay.url).list_checkpoints()]


def test_token_required_and_never_logged(tree, tmp_path, caplog):
    token = "s3cret-token-value"
    with caplog.at_level(logging.DEBUG, logger="dflash_eval.services.relay.server"):
        with RelayServer(tree, token=token, state_dir=tmp_path / "state", settle_seconds=5) as relay:
            with pytest.raises(RelayError, match="refused the token: check --token-file"):
                RelayClient(relay.url, token="wrong").list_checkpoints()
            with pytest.raises(RelayError, match="refused the token"):
                RelayClient(relay.url).manifest("run1/step_1000")
            status, headers, body = get(relay, "/v1/files/run2/final/model.safetensors")
            assert status == 401 and "error" in json.loads(body)
            status, _, _ = get(relay, "/v1/checkpoints", Authorization=f"Bearer {token}x")
            assert status == 401
            client = RelayClient(relay.url, token=token)
            assert len(client.list_checkpoints()) == 4
            client.download("run2/final", tmp_path / "dest")
    assert caplog.records  # requests were logged ...
    assert token not in caplog.text  # ... without the token


class _BadManifest(BaseHTTPRequestHandler):
    manifest: dict = {}

    def do_GET(self):
        body = json.dumps(self.manifest).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "files",
    [
        [{"name": "../evil.safetensors", "size": 3, "sha256": "a" * 64}],
        [{"name": ".hidden", "size": 3, "sha256": "a" * 64}],
        [{"name": "sub/x", "size": 3, "sha256": "a" * 64}],
        [{"name": "a", "size": -1, "sha256": "a" * 64}],
        [{"name": "a", "size": 3, "sha256": "A" * 64}],
        [{"name": "a", "size": 3, "sha256": "a" * 64}, {"name": "a", "size": 3, "sha256": "b" * 64}],
    ],
)
def test_malformed_manifest_refused_before_writing(files, tmp_path):
    handler = type("H", (_BadManifest,), {"manifest": {"path": "r/s", "files": files}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RelayError, match="malformed manifest"):
            RelayClient(url).download("r/s", tmp_path / "dest")
        assert not (tmp_path / "dest").exists()
        assert not (tmp_path / "evil.safetensors").exists()
    finally:
        server.shutdown()
        server.server_close()


def test_parse_checkpoint_url_errors():
    assert parse_checkpoint_url("https://h:1/a/b/") == ("https://h:1", "a/b")
    for bad in ["ftp://h/a", "http://h:1", "http://h:1/", "http://h:1/a/../b", "/a/b"]:
        with pytest.raises(RelayError):
            parse_checkpoint_url(bad)


def test_unreachable_relay_is_a_clear_error():
    with pytest.raises(RelayError, match="unreachable after 2 attempts"):
        RelayClient("http://127.0.0.1:9", retries=1, backoff=0.01, timeout=2).list_checkpoints()


def test_upstream_cut_is_resumed_by_the_middle_relay(tree, relay, tmp_path):
    relay.faults.put("cut")  # the upstream drops the middle relay's connection once
    with RelayServer(upstream=relay.url, state_dir=tmp_path / "middle") as middle:
        middle.upstream.backoff = 0.05
        manifest = RelayClient(middle.url, backoff=0.05).download("run1/step_1000", tmp_path / "a")
    data = (tree / "run1" / "step_1000" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == data
    assert relay.bytes_sent == manifest["total_bytes"]  # resumed upstream, nothing sent twice
    cached = tmp_path / "middle" / "cache" / "run1" / "step_1000" / "model.safetensors"
    assert cached.read_bytes() == data


def test_only_what_evaluation_needs_is_hashed_listed_and_sent(tmp_path):
    """A training save: the relay hashes, lists and sends config + weights + trainer_state.json, never
    the optimizer, unless a client asks for more with include patterns."""
    root = tmp_path / "runs"
    save = write_checkpoint(root / "run1" / "checkpoint-10", {"model.safetensors": MB, "optimizer.pt": 8 * MB,
                                                              "rng_state_0.pth": 1000, "trainer_state.json": 100})
    needed = sum((save / n).stat().st_size for n in ("config.json", "model.safetensors", "trainer_state.json"))
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=5) as relay:
        client = RelayClient(relay.url)
        (listed,) = client.list_checkpoints()
        assert listed["total_bytes"] == needed and listed["n_files"] == 3 and listed["layout"] == "hf"
        manifest = client.manifest("run1/checkpoint-10")
        assert [f["name"] for f in manifest["files"]] == ["config.json", "model.safetensors", "trainer_state.json"]
        assert relay.digests.misses == 3  # the optimizer was never read
        client.download("run1/checkpoint-10", tmp_path / "dest")
        assert relay.bytes_sent == needed and sorted(p.name for p in (tmp_path / "dest").iterdir()) == \
            ["config.json", "model.safetensors", "trainer_state.json"]

        wider = client.manifest("run1/checkpoint-10", include=["optimizer.*"])
        assert [f["name"] for f in wider["files"]] == ["config.json", "model.safetensors", "optimizer.pt", "trainer_state.json"]
        assert wider["key"] != manifest["key"]  # the key covers exactly the files fetched
        client.download("run1/checkpoint-10", tmp_path / "dest", manifest=wider)
        assert relay.bytes_sent == needed + 8 * MB  # only the optimizer more: the rest was there, verified
        assert (tmp_path / "dest" / "optimizer.pt").read_bytes() == (save / "optimizer.pt").read_bytes()
        with RelayServer(upstream=relay.url, state_dir=tmp_path / "middle", settle_seconds=5) as middle:
            through = RelayClient(middle.url).download("run1/checkpoint-10", tmp_path / "through", manifest=wider)
            assert through["key"] == wider["key"]  # a pull-through relay passes include patterns on


def test_broken_weights_answer_422_and_are_not_listed(tree, relay):
    weights = tree / "run1" / "step_1000" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(MB)
    settle(tree / "run1" / "step_1000")
    assert "run1/step_1000" not in [c["path"] for c in RelayClient(relay.url).list_checkpoints()]
    status, _, body = get(relay, "/v1/manifest/run1/step_1000")
    assert status == 422 and b"has 1048576 bytes where its header describes" in body
    with pytest.raises(RelayError, match="HTTP 422.*save did not complete"):
        RelayClient(relay.url).manifest("run1/step_1000")
