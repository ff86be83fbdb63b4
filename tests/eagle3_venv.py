"""The side venv with vLLM's Speculators (the EAGLE-3 reference), as the peers have theirs.

Speculators 0.9 pins transformers <= 5.19 (specdec's tests run 5.24): the venv sees this
environment's packages (torch among them) and installs its own transformers and what
Speculators imports. Made once, under $SPECDEC_CACHE/peers (else ~/.cache/specdec/peers), under
a lock so parallel test workers wait for one another; its pip log sits beside it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

NO_DEPS = ["speculators==0.9.0", "hs-connectors==0.9.0"]  # their own pins pull torchvision/torchaudio and CUDA wheels
WITH_DEPS = ["transformers==5.19.0", "datasets==5.1.0", "loguru==0.7.3", "pydantic-settings"]
CHECK = "from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig"


def root() -> Path:
    base = Path(os.environ["SPECDEC_CACHE"]) if os.environ.get("SPECDEC_CACHE") else Path.home() / ".cache" / "specdec"
    return base / "peers"


def python() -> Path:
    """The venv's Python, made first if it is missing; a RuntimeError naming its log if pip fails."""
    folder = root() / "speculators-venv"
    ready, log = folder / ".ready", root() / "speculators-venv.install.log"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(root() / "speculators-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            py = folder / "bin" / "python"
            steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(folder)],
                     [str(py), "-m", "pip", "install", "--no-deps", *NO_DEPS], [str(py), "-m", "pip", "install", *WITH_DEPS],
                     [str(py), "-c", CHECK]]  # fmt: skip
            with open(log, "w") as out:
                for step in steps:
                    if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode:
                        raise RuntimeError(f"the Speculators venv could not be made ({' '.join(step[:4])} ...); see {log}")
            ready.touch()
    return folder / "bin" / "python"
