"""benchmarks/ui_screenshots.py end to end: a Prefect server, the tiny run's steps evaluated in three series, five
pages (the runs list, whole and filtered by one series, a flow run, the history artifact, the served report)
screenshotted in headless Chromium, tau on each, and no series mixed with another."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.slow
def test_ui_screenshots(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (install it: apt-get install chromium)")
    out = tmp_path / "shots"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PREFECT_API_URL", None)
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ui_screenshots.py"), "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    pngs = sorted(out.glob("*.png"))
    assert [p.stem for p in pngs] == ["artifact-history", "flow-run", "report", "runs-series", "runs"], result.stdout
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert png.stat().st_size > 20_000, f"{png} is {png.stat().st_size} bytes: a blank page?"
