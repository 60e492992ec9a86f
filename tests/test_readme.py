"""The README's Python snippets run as written (issue #13.20): each ```python block in a
fresh interpreter, in a scratch folder, with no warning printed."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_snippet_runs_as_written(i, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="default")
    done = subprocess.run([sys.executable, "-c", BLOCKS[i]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README block {i + 1} failed:\n{BLOCKS[i]}\n{done.stderr[-3000:]}"
    assert "Warning" not in done.stderr, f"README block {i + 1} warns:\n{done.stderr[-3000:]}"
