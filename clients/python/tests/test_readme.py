"""The README's blocks marked ``<!-- runnable -->`` run as written against
the real server (its address put in for ``http://127.0.0.1:7700``), each in
its own interpreter and on its own server, with a short lease TTL so an
interrupt is learnt within half a second."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
#: A block's bound: each takes about a second.
BLOCK_TIMEOUT_S = 30
LEASE_TTL_MS = "1500"


def runnable_blocks() -> List[str]:
    text = README.read_text()
    return re.findall(r"<!-- runnable[^>]*-->\n```python\n(.*?)```", text, flags=re.S)


def test_the_readme_has_runnable_blocks() -> None:
    assert len(runnable_blocks()) >= 4


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_a_runnable_readme_block_runs(start_server, index: int) -> None:
    server = start_server("--lease-ttl-ms", LEASE_TTL_MS)
    code = runnable_blocks()[index].replace("http://127.0.0.1:7700", server.url)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert run.returncode == 0, f"block {index}:\n{code}\n{run.stdout}{run.stderr}"
