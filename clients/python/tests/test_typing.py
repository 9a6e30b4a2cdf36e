"""The package's type hints hold: mypy --strict passes on the package,
the FastAPI example, the test worker and tests/typing_usage.py (which
pins what a type checker sees, e.g. a decorated tool without its ctx),
and py.typed ships with the installed package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import agentgate

HERE = Path(__file__).resolve().parent
#: mypy on these few files takes about 2 s.
MYPY_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    """One cache for both runs: the second reuses the standard library's."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_mypy_strict_passes_on_the_package_the_example_and_the_typed_usage(mypy_cache):
    checked = [HERE.parent / "src" / "agentgate", HERE.parent / "examples" / "fastapi_app.py", HERE / "worker.py", HERE / "typing_usage.py"]
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(mypy_cache), *map(str, checked)],
        capture_output=True,
        text=True,
        timeout=MYPY_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_refuses_a_decorated_tool_called_with_its_ctx(tmp_path, mypy_cache):
    misuse = tmp_path / "misuse.py"
    misuse.write_text(
        "from agentgate import Gate, ToolContext\n"
        "gate = Gate('http://127.0.0.1:7700')\n"
        "@gate.tool\n"
        "def book(ctx: ToolContext, amount: int) -> str:\n"
        "    return ctx.idempotency_key\n"
        "book(None, 1)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(mypy_cache), str(misuse)],
        capture_output=True,
        text=True,
        timeout=MYPY_TIMEOUT_S,
    )
    assert run.returncode == 1 and 'No overload variant of "__call__" of "Tool"' in run.stdout, run.stdout
    assert 'misuse.py:6: error' in run.stdout, run.stdout


def test_py_typed_ships_with_the_package():
    assert (Path(agentgate.__file__).parent / "py.typed").is_file()
