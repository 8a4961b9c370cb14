"""pip-install a plugin package of tests/fixtures (its own pyproject and entry point) into a
separate target directory, without touching paged or the test environment."""

import shutil
import subprocess
import sys
from pathlib import Path
from helpers import FIXTURES




def pip_install_fixture(name: str, target: Path, build: Path) -> Path:
    src = build / name
    shutil.copytree(FIXTURES / name, src)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target
