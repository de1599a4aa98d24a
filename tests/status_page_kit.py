"""The operator's status page in a real browser: ``fedllm flower status RUN_DIR --serve`` in a process of its own,
and Debian's headless Chromium rendering it (its scripts run: the DOM is read after they filled the page)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from flower_cluster import free_port, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def status_page(run_dir: Path, log: Path):
    """The page of ``run_dir`` served on a free 127.0.0.1 port; yields its URL once it answers."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fedllm", "flower", "status", str(run_dir), "--serve",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "at http://127.0.0.1:" in log.read_text() or proc.poll() is not None, 120,
                   "the status page to listen", log)
        assert proc.poll() is None, log.read_text()
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def chromium(url: str, *options: str) -> str:
    """What headless Chromium prints for ``url`` with ``options`` (``--dump-dom``: the DOM after the scripts ran)."""
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                              "--disable-background-networking", "--disable-component-update", "--disable-sync",
                              f"--user-data-dir={profile}", "--virtual-time-budget=4000", *options, url],
                             capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def rendered(url: str) -> dict[str, str]:
    """The page's figures as the browser rendered them: element id -> text."""
    dom = chromium(url, "--dump-dom")
    return dict(re.findall(r'<(?:b|span|small) id="(\w+)">([^<]*)<', dom)) | {"dom": dom}
