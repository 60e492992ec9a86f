"""The notebooks as learners open them: ``make lab`` (JupyterLab) starts on localhost and
serves a chapter. The server is bounded in time and stopped by the test itself."""
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


def test_jupyterlab_serves_a_chapter(tmp_path):
    lab = Path(sys.executable).with_name("jupyter-lab")
    if not lab.exists() and shutil.which("jupyter-lab") is None:
        pytest.skip("JupyterLab is not installed here (it comes with the 'book' extra: make lab)")
    port = _free_port()
    proc = subprocess.Popen(
        [str(lab), "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1", "--IdentityProvider.token=",
         "--ServerApp.password=", f"--ServerApp.root_dir={ROOT}", "--ServerApp.open_browser=False"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**__import__("os").environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_DATA_DIR": str(tmp_path)})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if _get(f"{base}/api/status")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "JupyterLab did not start within 90 s"
            time.sleep(0.5)
        status, body = _get(f"{base}/api/contents/book/ch01_memory_wall.ipynb")
        assert status == 200 and json.loads(body)["type"] == "notebook"
        status, body = _get(f"{base}/lab/tree/book/ch01_memory_wall.ipynb")
        assert status == 200 and b"JupyterLab" in body
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
