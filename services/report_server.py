"""Serve one report folder (`<store>/report`, reporting/report.py) read-only over HTTP.

The Prefect UI links to the report. A file:// link is blocked by browsers and names a path on the eval
machine only; `dflash-eval serve` therefore serves the folder from its own process and tells the flow
runs where: `$DFLASH_REPORT_URL` is the base URL under which `<store>/report/` is served, so the report
is `${DFLASH_REPORT_URL}report.html` (report_url() reads it). A user who puts a reverse proxy in front
sets the variable to the proxy's address.

What is served: GET and HEAD of the report's files (.html, .md, .png) inside the folder, `/` being
report.html. No listings, nothing hidden (the `.<name>.partial` files a write is filling), nothing that
resolves outside the folder. Every evaluation rewrites the folder, so nothing may be cached without
asking again (`Cache-Control: no-cache`). reporting/report.py writes each file to a temporary name and
renames it into place: a request opens either the old or the new file, never one half written.

Bounded as every server we ship (dflash_eval.services.http_server): MAX_CONNECTIONS connections at once (a browser
opens a few), a request must arrive whole within REQUEST_SECONDS (an idle keep-alive one is closed then).
"""

import logging
import os
import shutil
import stat
from email.utils import formatdate
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from dflash_eval.services.http_server import BackgroundServer, DeadlineRequestHandler

REPORT_URL_ENV = "DFLASH_REPORT_URL"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
INDEX = "report.html"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".md": "text/markdown; charset=utf-8", ".png": "image/png"}
# Opening the resolved path must not follow a link swapped in after it was resolved.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
MAX_CONNECTIONS = 32
REQUEST_SECONDS = 30.0

logger = logging.getLogger(__name__)


def report_url() -> str | None:
    """The base URL under which `<store>/report/` is served (`$DFLASH_REPORT_URL`), ending in `/`; None when
    the variable is unset or empty. The report itself is `report_url() + "report.html"`."""
    url = os.environ.get(REPORT_URL_ENV, "").strip()
    if not url:
        return None
    return url if url.endswith("/") else url + "/"


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ReportServer(BackgroundServer):
    """Serve `folder` read-only over HTTP at `url` (`http://HOST:PORT/`, the bound port when port=0).

    Binds in the constructor (PortInUse if the port is taken), so a caller fails before doing any work;
    starts, serves and stops as every server (BackgroundServer). The folder need not exist yet: files
    are looked up per request (404 until the first report).
    """

    def __init__(self, folder: str | os.PathLike, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        self.folder = Path(folder).absolute()
        super().__init__(host, port, self._handler_class(), MAX_CONNECTIONS, MAX_CONNECTIONS, name="report server",
                         logger=logger)
        self.url += "/"  # the base of the report's files: `url + "report.html"`

    def _open_file(self, url_path: str) -> tuple[BinaryIO, os.stat_result, str]:
        """(open file, its fstat, content type) of the report file a request path names; raises _Refused."""
        if not url_path.startswith("/"):
            raise _Refused(400, "the path must start with /")
        segments = [unquote(part, errors="strict") for part in urlsplit(url_path).path.split("/")[1:]]
        if segments == [""]:
            segments = [INDEX]
        for segment in segments:
            if segment in (".", "..") or "/" in segment or "\\" in segment or "\x00" in segment:
                raise _Refused(403, "the path must stay inside the report folder")
            if segment == "" or segment.startswith("."):  # no folder listings, no files being written
                raise _Refused(404, "not found")
        content_type = CONTENT_TYPES.get(os.path.splitext(segments[-1])[1].lower())
        if content_type is None:
            raise _Refused(404, "not found")
        root = os.path.realpath(self.folder)
        real = os.path.realpath(os.path.join(root, *segments))
        if os.path.commonpath([root, real]) != root or real == root:  # a link that leads out of the folder
            raise _Refused(403, "the path leads outside the report folder")
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except OSError:  # not there (yet), unreadable, or a link swapped in since it was resolved
            raise _Refused(404, "not found") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise _Refused(404, "not found")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st, content_type

    def _handler_class(self) -> type[DeadlineRequestHandler]:
        server = self

        class Handler(DeadlineRequestHandler):
            server_version = "dflash-report"
            request_timeout = REQUEST_SECONDS

            def do_GET(self) -> None:
                self._send(body=True)

            def do_HEAD(self) -> None:
                self._send(body=False)

            def _refuse_method(self) -> None:
                self.close_connection = True  # its body is not read
                self._error(405, "read-only: GET and HEAD only", {"Allow": "GET, HEAD"})

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method

            def _send(self, body: bool) -> None:
                try:
                    file, st, content_type = server._open_file(self.path)
                except _Refused as e:
                    self._error(e.status, e.message)
                    return
                except UnicodeDecodeError:
                    self._error(400, "the path is not UTF-8")
                    return
                with file:  # the file opened: a rename over it meanwhile changes nothing of what is sent
                    self.send_response(200)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(st.st_size))
                    self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("X-Content-Type-Options", "nosniff")
                    self.end_headers()
                    if body:
                        shutil.copyfileobj(file, self.wfile)

            def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
                data = (message + "\n").encode("utf-8")
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def log_message(self, format: str, *args) -> None:
                # not on stderr: `dflash-eval serve`'s console is for the flow runs' logs
                logger.debug("%s %s", self.address_string(), format % args)

        return Handler
