"""services/report_server.py: the report folder over HTTP, read-only, on loopback with real requests."""

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from dflash_eval.services.http_server import PortInUse
from dflash_eval.services.report_server import REPORT_URL_ENV, ReportServer, report_url
from dflash_eval.storage import Store
from tests.test_report import fabricate
from tests.waiting import answers, wait_until

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32  # only the bytes are checked, not the image


@pytest.fixture
def report_folder(tmp_path) -> Path:
    folder = tmp_path / "store" / "report"
    (folder / "img").mkdir(parents=True)
    (folder / "report.html").write_text("<!DOCTYPE html><html><body><h1>DFlash drafter report</h1></body></html>")
    (folder / "report.md").write_text("# DFlash drafter report\n\n![tau](img/tau.png)\n")
    (folder / "img" / "tau.png").write_bytes(PNG)
    (tmp_path / "store" / "secret.txt").write_text("not for the web")
    return folder


@pytest.fixture
def server(report_folder):
    with ReportServer(report_folder, port=0) as server:
        yield server


def raw_get(server: ReportServer, path: str, method: str = "GET") -> http.client.HTTPResponse:
    """A request with the path sent exactly as given (requests would normalise `..` away)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest(method, path, skip_accept_encoding=True)
    connection.endheaders()
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_serves_the_report_and_its_images_with_their_types(server, report_folder):
    assert server.url == f"http://127.0.0.1:{server.port}/" and server.port != 0
    page = requests.get(server.url + "report.html", timeout=10)
    assert page.status_code == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["Cache-Control"] == "no-cache"
    assert page.content == (report_folder / "report.html").read_bytes()

    image = requests.get(server.url + "img/tau.png", timeout=10)
    assert image.status_code == 200 and image.headers["Content-Type"] == "image/png" and image.content == PNG
    markdown = requests.get(server.url + "report.md", timeout=10)
    assert markdown.headers["Content-Type"] == "text/markdown; charset=utf-8"
    assert markdown.text.startswith("# DFlash drafter report")

    head = requests.head(server.url + "report.html", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["Content-Length"]) == len(page.content)


def test_the_root_is_the_report(server, report_folder):
    root = requests.get(server.url, timeout=10)
    assert root.status_code == 200 and root.headers["Content-Type"] == "text/html; charset=utf-8"
    assert root.content == (report_folder / "report.html").read_bytes()


def test_a_rewritten_report_is_served_at_once(server, report_folder):
    assert "second" not in requests.get(server.url, timeout=10).text
    (report_folder / "report.html").write_text("<html>second</html>")
    assert requests.get(server.url, timeout=10).text == "<html>second</html>"


def test_no_listings_hidden_files_or_other_types(server, report_folder):
    (report_folder / ".report.html.abc.partial").write_text("half written")
    (report_folder / "notes.txt").write_text("not a report file")
    for path in ("/img/", "/img", "/.report.html.abc.partial", "/notes.txt", "/missing.html"):
        assert raw_get(server, path).status == 404, path


@pytest.mark.parametrize("path", ["/../secret.txt", "/img/../../secret.txt", "/%2e%2e/secret.txt",
                                  "/..%2fsecret.txt", "/../report/report.html"])
def test_paths_out_of_the_folder_are_refused(server, path):
    assert raw_get(server, path).status in (403, 404)


def test_absolute_paths_stay_inside_the_folder(server, report_folder):
    outside = report_folder.parent / "secret.txt"
    assert raw_get(server, str(outside)).status == 404  # /tmp/.../secret.txt looked up under the folder
    assert raw_get(server, f"//{outside}").status == 404
    assert raw_get(server, f"http://127.0.0.1:{server.port}{outside}").status == 400  # not a path
    assert raw_get(server, "secret.txt").status == 400


def test_links_out_of_the_folder_are_refused_and_links_inside_followed(server, report_folder, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "leak.png").write_bytes(PNG)
    (outside / "leak.html").write_text("<html>outside</html>")
    (report_folder / "leak.png").symlink_to(outside / "leak.png")
    (report_folder / "out").symlink_to(outside)
    (report_folder / "alias.html").symlink_to(report_folder / "report.html")
    assert raw_get(server, "/leak.png").status == 403
    assert raw_get(server, "/out/leak.html").status == 403
    assert raw_get(server, "/alias.html").status == 200


def test_writes_are_refused(server, report_folder):
    before = (report_folder / "report.html").read_bytes()
    for method in ("POST", "PUT", "DELETE"):
        response = requests.request(method, server.url + "report.html", data=b"x", timeout=10)
        assert response.status_code in (405, 501), method
    assert requests.post(server.url, timeout=10).headers["Allow"] == "GET, HEAD"
    assert (report_folder / "report.html").read_bytes() == before


def test_a_folder_not_written_yet_is_served_once_it_is(tmp_path):
    folder = tmp_path / "report"
    with ReportServer(folder, port=0) as server:
        assert requests.get(server.url, timeout=10).status_code == 404
        folder.mkdir()
        (folder / "report.html").write_text("<html>first report</html>")
        assert requests.get(server.url, timeout=10).text == "<html>first report</html>"


def test_a_taken_port_is_a_clear_error(report_folder):
    with ReportServer(report_folder, port=0) as first:
        with pytest.raises(PortInUse, match=f"port {first.port} on 127.0.0.1 is already in use"):
            ReportServer(report_folder, port=first.port)
        assert requests.get(first.url, timeout=10).status_code == 200  # the first one is unharmed


def test_stop_releases_the_port(report_folder):
    server = ReportServer(report_folder, port=0).start()
    port = server.port
    server.stop()
    with ReportServer(report_folder, port=port) as again:
        assert requests.get(again.url, timeout=10).status_code == 200


def test_every_interface_is_named_by_the_machine_s_name(report_folder):
    with ReportServer(report_folder, host="0.0.0.0", port=0) as server:
        assert server.url == f"http://{socket.getfqdn()}:{server.port}/"
        assert requests.get(f"http://127.0.0.1:{server.port}/", timeout=10).status_code == 200


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("  ", None),
                                             ("http://eval:8765", "http://eval:8765/"),
                                             ("http://eval:8765/", "http://eval:8765/"),
                                             (" https://proxy.example/dflash/report ", "https://proxy.example/dflash/report/")])
def test_report_url_ends_in_a_slash(monkeypatch, value, expected):
    assert REPORT_URL_ENV == "DFLASH_REPORT_URL"
    if value is None:
        monkeypatch.delenv(REPORT_URL_ENV, raising=False)
    else:
        monkeypatch.setenv(REPORT_URL_ENV, value)
    assert report_url() == expected


def _line_with(process: subprocess.Popen, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return line
    process.kill()
    raise AssertionError(f"no line with {text!r} in:\n{''.join(seen)}{process.stderr.read()}")


@pytest.mark.slow  # starts processes or waits on purpose
def test_command_line_writes_and_serves_the_report(tmp_path):
    store = Store(tmp_path / "store")
    for step, tau in [(1000, 3.1), (2000, 3.6)]:
        fabricate(store, f"/runs/a/step_{step}", step, tau, (tau - 0.2, tau + 0.2))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "dflash_eval.cli", "report", "--store", str(store.root), "--serve",
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=Path(__file__).parent.parent,
                               # Ctrl+C reaches it even when pytest runs as a background job of a script, whose
                               # shell ignores SIGINT (an ignored signal stays ignored across exec)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = _line_with(process, "report.html; Ctrl+C stops", timeout=60)
        url = line.split(" at ", 1)[1].split(";", 1)[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/report.html")
        wait_until(answers(url), 60, "the report server", process)  # bound; on busy cores it may answer late
        page = requests.get(url, timeout=10)
        assert page.status_code == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
        assert page.content == (store.root / "report" / "report.html").read_bytes()  # --out: <store>/report
        assert "step_2000" in page.text
        images = sorted(p.name for p in (store.root / "report" / "img").iterdir())
        assert images and requests.get(url.replace("report.html", f"img/{images[0]}"), timeout=10).content[:4] == PNG[:4]
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_command_line_without_out_or_serve_asks_for_out(tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    result = CliRunner().invoke(app, ["report", "--store", str(tmp_path / "store")])
    assert result.exit_code == 2 and "--out" in result.output


def test_command_line_on_a_taken_port_says_which_option_to_change(tmp_path, report_folder):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = Store(tmp_path / "scored")
    fabricate(store, "/runs/a/step_1000", 1000, 3.1, (2.9, 3.3))
    with ReportServer(report_folder, port=0) as taken:
        result = CliRunner().invoke(app, ["report", "--store", str(store.root), "--serve", "--port", str(taken.port)])
    assert result.exit_code == 2
    assert f"port {taken.port} on 127.0.0.1 is already in use; choose another port with --port" in result.output
    assert not (store.root / "report").exists()  # refused before any work


@pytest.fixture
def serve_without_runner(monkeypatch, tmp_path):
    """`dflash-eval serve` with the Prefect runner replaced by a stand-in that fetches, as a flow run would,
    what $DFLASH_REPORT_URL names (nothing of Prefect or torch is imported)."""
    import types

    from typer.testing import CliRunner

    from dflash_eval.cli import app

    seen = {}

    def serve_deployments(settings, **kwargs):
        seen["url"] = os.environ.get(REPORT_URL_ENV)
        seen["store"] = settings.output.store
        if seen["url"] and "proxy" not in seen["url"]:
            seen["response"] = requests.get(seen["url"] + "report.html", timeout=10)

    monkeypatch.setitem(sys.modules, "dflash_eval.flows.deployments", types.SimpleNamespace(serve_deployments=serve_deployments))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.delenv(REPORT_URL_ENV, raising=False)
    store = tmp_path / "store"

    def serve(*options: str):
        result = CliRunner().invoke(app, ["serve", "--target", "t", "--prompts", "p", "--store", str(store), *options])
        assert result.exit_code == 0, result.output
        return result.output, seen

    yield serve, store
    # serve sets it in this very process (for its flow runs), out of monkeypatch's sight: later tests must not see it
    os.environ.pop(REPORT_URL_ENV, None)


def test_serve_serves_the_store_s_report_to_its_flow_runs(serve_without_runner):
    serve, store = serve_without_runner
    output, seen = serve("--report-port", "0")
    assert seen["url"].startswith("http://127.0.0.1:") and seen["url"].endswith("/")
    assert f"report server at {seen['url']}report.html" in output
    assert (store / "report").is_dir()  # created, so the server starts before the first report
    assert seen["response"].status_code == 404  # no report yet: nothing, not an error page of another server
    with pytest.raises(requests.ConnectionError):  # stopped with the runner
        requests.get(seen["url"], timeout=5)


def test_serve_keeps_a_report_url_the_user_set(serve_without_runner, monkeypatch):
    serve, _ = serve_without_runner
    monkeypatch.setenv(REPORT_URL_ENV, "https://proxy.example/dflash")
    output, seen = serve("--report-port", "0")
    assert seen["url"] == "https://proxy.example/dflash"
    assert "flow runs link to https://proxy.example/dflash/report.html" in output


def test_serve_without_the_report_server(serve_without_runner):
    serve, store = serve_without_runner
    output, seen = serve("--no-report-server")
    assert seen["url"] is None and "report server" not in output and not (store / "report").exists()
