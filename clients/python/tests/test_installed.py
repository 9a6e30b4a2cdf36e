"""When clients/check-packages.sh runs this suite against the built wheel
(``AGENTGATE_PY_EXPECT_INSTALLED=1``), the ``agentgate`` the tests and their
worker processes import is the wheel's copy in this venv's site-packages,
never the source tree. Skipped in the ordinary (editable) run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import agentgate

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "src"

pytestmark = pytest.mark.skipif(
    os.environ.get("AGENTGATE_PY_EXPECT_INSTALLED") != "1",
    reason="the source-tree run; clients/check-packages.sh python runs this against the installed wheel",
)


def test_agentgate_is_the_installed_wheel_in_site_packages() -> None:
    imported = Path(agentgate.__file__).resolve()
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert imported.is_relative_to(site_packages), f"{imported} is not in {site_packages}"
    assert site_packages.is_relative_to(Path(sys.prefix).resolve()), "not the venv's site-packages"
    assert not imported.is_relative_to(SOURCE.resolve()), imported
    on_path = [Path(entry or os.getcwd()).resolve() for entry in sys.path]
    assert SOURCE.resolve() not in on_path, sys.path
    assert (imported.parent / "py.typed").is_file()


def test_only_agentgate_client_provides_the_import_and_not_editable() -> None:
    # PyPI's `agentgate`, `agentgate-sdk` and `agentgate-py` ship an
    # `agentgate` package too; none of them may be in this venv.
    providers = importlib.metadata.packages_distributions().get("agentgate", [])
    assert {re.sub(r"[-_.]+", "-", name).lower() for name in providers} == {"agentgate-client"}, providers
    dist = importlib.metadata.distribution("agentgate-client")
    assert dist.version == agentgate.__version__
    direct_url = dist.read_text("direct_url.json")
    assert direct_url is None or not json.loads(direct_url).get("dir_info", {}).get("editable"), direct_url


def test_a_worker_process_imports_the_same_copy() -> None:
    run = subprocess.run(
        [sys.executable, "-c", "import agentgate; print(agentgate.__file__)"],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert Path(run.stdout.strip()).resolve() == Path(agentgate.__file__).resolve()
