"""What a person sees in the Prefect UI after evaluating checkpoints: screenshots, and whether tau shows.

Starts a Prefect server (`prefect server start` on a free port, a temporary PREFECT_HOME, analytics off,
PREFECT_UI_API_URL pointing at that port: without it the UI's /ui-settings say
http://127.0.0.1:4200/api and every page shows "Can't connect to Server API at http://127.0.0.1:4200/api"),
evaluates each drafter step of the tiny trained Qwen3 run (dflash_eval.tiny.build) with `dflash-eval run`, and
its first step in two more series (half the new tokens in the same store; another store), checks through the
API that no series mixes (the runs tagged `series:<key>` and the `<key>-history` artifact hold exactly the
taus evaluated in that series), starts the report server (`dflash-eval report --serve`), then opens four pages in headless Chromium:

  runs       /runs                                     the runs list
  runs-series /runs?tag=series:<key>                   the runs list filtered by the main series' tag: its
                                                       runs only (no other series' tag may show)
  flow-run   /runs/flow-run/<id>?tab=Details           the newest flow run (the Details tab holds its state
                                                       message; the page opens on Logs)
  artifact   /artifacts/artifact/<id>                  the newest version of the `<series>-history` artifact
                                                       (its key page, /artifacts/key/<key>, which the
                                                       Artifacts list links to, shows only the description
                                                       and the versions, not the content)
  report     http://127.0.0.1:<port>/report.html       the served report

Paths are those of the UI Prefect's own logs link to ("View at .../runs/flow-run/<id>"); `--ui v2` opens the
same pages of the V2 UI (under /v2, where the server's root redirects a browser without a saved choice).

Each page is loaded with `chromium --headless --screenshot=FILE --dump-dom --virtual-time-budget=MS`: one
load gives both the PNG and the DOM, whose text (scripts and styles left out) is checked. The SPA sometimes
dumps before its data arrived, so a page is loaded again with a longer budget until the text holds what the
API says it must (the run's name and id, the artifact's id) and tau: the word "tau" followed within 80
characters by a number with two or more decimals ("tau 3.870", "tau macro 3.870").

Prints one line per page (page, URL, screenshot, whether tau shows and the text found) and writes
<out>/<page>.png and <out>/<page>.txt (the page's text). Exits 1 when a page lacks tau or a series mixes, 2 on
an error.
Needs Chromium (Debian: `apt-get install chromium`).

Run: .venv/bin/python benchmarks/ui_screenshots.py [--out DIR] [--ui v1|v2] [--artifact history]
  --artifact NAME    check the `<series>-NAME` artifact instead of `<series>-history` (e.g. scores)
"""

import argparse
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain checkout, not installed too
from benchmarks.prefect_server import BIN, api, free_port, start_prefect_server, stop  # noqa: E402
from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run  # noqa: E402

WINDOW = "1400,1000"
BUDGETS_MS = (5000, 10000, 20000, 40000)  # virtual time per load, longer on each retry
TAU = re.compile(r"\btau\b.{0,80}?(?<![\d.])\d+\.\d{2,}(?![\d.])", re.IGNORECASE | re.DOTALL)
NO_API = "Can't connect to Server API"


class Failure(Exception):
    """An error that stops the script (exit 2) with its message."""


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    raise Failure("chromium not found: install it (Debian/Ubuntu: `apt-get install chromium`)")


@dataclass
class Evaluated:
    tau: str  # as the run's tau: tag writes it
    series: str  # its series key (results["series"])


def evaluate(tiny, steps: list[Path], store: Path, max_new_tokens: int, env: dict, logs: Path) -> list[Evaluated]:
    """`dflash-eval run` of each step, with what each run's --out says."""
    evaluated = []
    for step in steps:
        out = logs / f"run-{store.name}-{max_new_tokens}-{step.name}.json"
        cmd = [str(BIN / "dflash-eval"), "run", "--target", str(tiny.target_dir), "--drafter", str(step),
               "--prompts", str(tiny.prompts_file), "--max-new-tokens", str(max_new_tokens), "--store", str(store),
               "--out", str(out)]
        t = time.perf_counter()
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out.with_suffix(".log").write_text(result.stdout)
        if result.returncode != 0:
            raise Failure(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}")
        results = json.loads(out.read_text())
        evaluated.append(Evaluated(f"{results['tau_macro']:.3f}", results["series"]["key"]))
        print(f"evaluated {step.name} into {store.name} at {max_new_tokens} new tokens in "
              f"{time.perf_counter() - t:.1f} s: series {results['series']['key']}")
    return evaluated


def check_series_apart(url: str, evaluated: list[Evaluated]) -> list[str]:
    """What mixes: for each series, the runs the API lists under its `series:` tag must be exactly the runs
    evaluated in it (their tau tags those runs' taus), and its history artifact must hold exactly its rows."""
    problems = []
    for key in sorted({e.series for e in evaluated}):
        mine = sorted(e.tau for e in evaluated if e.series == key)
        runs = api(url, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"series:{key}"]}}})
        taus = sorted(t.removeprefix("tau:") for run in runs for t in run["tags"] if t.startswith("tau:"))
        if taus != mine:
            problems.append(f"the runs tagged series:{key} show taus {taus}; evaluated in it: {mine}")
        history = api(url, "/artifacts/filter", {"artifacts": {"key": {"any_": [f"{key}-history"]}},
                                                  "sort": "CREATED_DESC", "limit": 1})
        rows = history[0]["data"] if history else None
        rows = json.loads(rows) if isinstance(rows, str) else rows
        if not rows or sorted(r["tau macro"] for r in rows) != mine:
            problems.append(f"the newest {key}-history holds {rows}; evaluated in it: {mine}")
    return problems


def start_report_server(store: Path, port: int, env: dict, log: Path) -> subprocess.Popen:
    """`dflash-eval report --serve` over <store>/report; returns once report.html is served."""
    cmd = [str(BIN / "dflash-eval"), "report", "--serve", "--store", str(store), "--port", str(port)]
    server = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/report.html"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise Failure(f"{' '.join(cmd)} exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.3)
    stop(server)
    raise Failure(f"{' '.join(cmd)}: {url} not served within 60 s:\n{log.read_text()[-3000:]}")


@dataclass
class Page:
    name: str
    url: str
    must_show: list[str]  # text the rendered page holds once its data arrived
    must_not_show: tuple[str, ...] = ()  # text that would mean series mixed on it


@dataclass
class Seen:
    page: Page
    png: Path
    text: str
    tau: str | None  # the matched text, None when tau does not show
    budget_ms: int


def page_text(dom: str) -> str:
    """The text of a dumped DOM, as one line: no scripts, styles or templates."""
    text = re.sub(r"<(script|style|template|noscript)\b[^>]*>.*?</\1\s*>", " ", dom, flags=re.S | re.I)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    return re.sub(r"\s+", " ", html.unescape(text)).strip()


def load(chromium: str, profile: Path, url: str, png: Path, budget_ms: int) -> str:
    """One headless load of url: writes the screenshot to png, returns the DOM."""
    png.unlink(missing_ok=True)
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile}", f"--window-size={WINDOW}",
           f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", "--dump-dom", url]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        dom, err = process.communicate(timeout=60 + budget_ms / 1000)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise Failure(f"chromium did not finish loading {url} within {60 + budget_ms // 1000} s") from None
    if process.returncode != 0 or not png.exists():
        noise = "\n".join(line for line in err.splitlines() if "dbus" not in line)
        raise Failure(f"chromium failed on {url} (exit {process.returncode}):\n{noise[-2000:]}")
    return dom


def look(chromium: str, profile: Path, page: Page, out: Path) -> Seen:
    """Load a page until it rendered its data and shows tau, or until the longest budget."""
    png = out / f"{page.name}.png"
    rendered = None
    for budget in BUDGETS_MS:
        text = page_text(load(chromium, profile, page.url, png, budget))
        if NO_API in text:
            raise Failure(f"{page.url}: the UI shows {NO_API!r}: {text[text.index(NO_API):][:120]}")
        if all(s in text for s in page.must_show):
            match = TAU.search(text)
            rendered = Seen(page, png, text, match.group(0) if match else None, budget)
            if match:
                break
    if rendered is None:
        missing = [s for s in page.must_show if s not in text]
        raise Failure(f"{page.url} did not render within {BUDGETS_MS[-1]} ms of virtual time: its text lacks "
                      f"{missing}; it reads: {text[:600]}")
    (out / f"{page.name}.txt").write_text(rendered.text + "\n")
    return rendered


def excerpt(seen: Seen, width: int = 400) -> str:
    """The page's text from just before the first thing it must show (past the navigation), or its start."""
    at = min((seen.text.index(s) for s in seen.page.must_show), default=0)
    start = max(0, at - 40)
    return ("..." if start else "") + seen.text[start:start + width] + ("..." if len(seen.text) > start + width else "")


def listed(text: str) -> str:
    """The runs list's rows: the page's text after "<N> runs" (before it, the filter's menus name every tag)."""
    found = re.search(r"\b\d+ runs?\b", text)
    return text[found.end():] if found else text


def pages(url: str, ui_base: str, report_url: str, series: str, others: list[str], artifact_name: str) -> list[Page]:
    """The pages to look at, with what each must show (and, filtered by a series, must not), from the API."""
    runs = api(url, "/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"is_null_": True},
                                                        "state": {"type": {"any_": ["COMPLETED"]}}},
                                          "sort": "START_TIME_DESC", "limit": 1})
    if not runs:
        raise Failure("the server has no completed flow run")
    run = runs[0]
    key = f"{series}-{artifact_name}"
    found = api(url, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC",
                                           "limit": 1})
    if not found:
        keys = sorted({a["key"] for a in api(url, "/artifacts/filter", {"limit": 200}) if a.get("key")})
        raise Failure(f"no artifact with key {key!r}; the server has: {', '.join(keys) or 'none'}")
    artifact = found[0]
    in_series = api(url, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"series:{series}"]}}})
    return [Page("runs", f"{ui_base}/runs", [run["name"]]),
            # the runs list filtered by the series' tag, as a person filters it: only that series' runs and taus
            Page("runs-series", f"{ui_base}/runs?tag={urllib.parse.quote(f'series:{series}')}",
                 [f"{len(in_series)} runs", *sorted({r["name"] for r in in_series})],
                 tuple(f"series:{other}" for other in others)),
            Page("flow-run", f"{ui_base}/runs/flow-run/{run['id']}?tab=Details", [run["name"], run["id"]]),
            Page(f"artifact-{artifact_name}", f"{ui_base}/artifacts/artifact/{artifact['id']}",
                 [key, artifact["id"]]),
            Page("report", report_url, [])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("ui-screenshots"), help="Folder for the PNGs and texts.")
    parser.add_argument("--ui", choices=["v1", "v2"], default="v1",
                        help="v1: the pages Prefect's logs link to (default); v2: the same under /v2.")
    parser.add_argument("--artifact", default="history", help="Check the <series>-NAME artifact (default history).")
    parser.add_argument("--port", type=int, default=None, help="The Prefect server's port (default: a free one).")
    args = parser.parse_args()

    chromium = find_chromium()
    tiny = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    max_new = tiny.record["settings"]["max_new_tokens"]
    args.out.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="dflash-ui-screenshots-") as tmp:
        root = Path(tmp)
        try:
            port = args.port or free_port()
            while port == 4200:
                port = free_port()
            try:
                server, url = start_prefect_server(root / "prefect", port, root / "prefect-server.log")
            except RuntimeError as e:
                raise Failure(str(e)) from None
            started.append(server)
            print(f"Prefect server: http://127.0.0.1:{port} (UI calls {url})")
            report_port = free_port()
            env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(root / "prefect"),
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DFLASH_REPORT_URL": f"http://127.0.0.1:{report_port}/"}
            store = root / "store"
            # two more series beside the steps' own: other settings in the same store, and another store; their
            # first step only, evaluated before the last step so the pages' newest run is the main series'
            evaluated = evaluate(tiny, tiny.drafter_steps[:-1], store, max_new, env, root)
            evaluated += evaluate(tiny, tiny.drafter_steps[:1], store, max_new // 2, env, root)
            evaluated += evaluate(tiny, tiny.drafter_steps[:1], root / "other-store", max_new, env, root)
            evaluated += evaluate(tiny, tiny.drafter_steps[-1:], store, max_new, env, root)
            mixed = check_series_apart(url, evaluated)
            started.append(start_report_server(store, report_port, env, root / "report-server.log"))
            ui_base = f"http://127.0.0.1:{port}" + ("/v2" if args.ui == "v2" else "")
            series = evaluated[-1].series
            others = sorted({e.series for e in evaluated} - {series})
            seen = [look(chromium, root / "chromium", page, args.out)
                    for page in pages(url, ui_base, f"http://127.0.0.1:{report_port}/report.html", series, others,
                                      args.artifact)]
            mixed += [f"{s.page.name} lists {shown!r}" for s in seen for shown in s.page.must_not_show
                      if shown in listed(s.text)]
        except Failure as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            for process in reversed(started):
                stop(process)
    for s in seen:
        found = f"tau shown: {s.tau!r}" if s.tau else f"NO tau; the page reads: {excerpt(s)!r}"
        print(f"{s.page.name:18} {s.page.url}  {s.png}  {found}")
    missing = [s.page.name for s in seen if not s.tau]
    if missing:
        print(f"tau missing on: {', '.join(missing)}")
    for problem in mixed:
        print(f"series mixed: {problem}")
    if missing or mixed:
        return 1
    print(f"tau shows on every page; {len({e.series for e in evaluated})} series, each with only its own runs "
          "and rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
