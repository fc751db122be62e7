"""The rollout manager's process starts without torch.

The manager scores groups, keeps the registry of published versions and cuts manifests into broadcast specs;
none of it needs a tensor. Importing torch there cost ~3 CPU-seconds and ~200 MB in every run (measured: the
import of ``relax.rollout.manager`` went from 3.5 to 0.9 CPU-seconds without it), so a module that pulls torch
back into the manager's imports fails here, with the chain that brought it.
"""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
class Trace:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            import traceback
            chain = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if "/relax/" in f.filename]
            print("torch imported via " + " <- ".join(reversed(chain)))
            sys.exit(3)
sys.meta_path.insert(0, Trace())
import relax.rollout.manager, relax.rollout.control.server  # noqa: E401
"""


def test_the_manager_and_control_plane_import_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
