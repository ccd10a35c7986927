import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# One torch thread per test process: on a 2-core machine that another program also uses, torch's default (one
# thread per core) made a small test 30x slower (105 s against 3.5 s). Subprocesses get the same through the
# environment.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent

# The user program directory (`dflash-graph trace-model` writes there, check reads it): an empty one for the suite,
# so programs a user derived never change what the tests see (tests that derive one point it at their tmp_path).
_PROGRAMS = tempfile.mkdtemp(prefix="dflash-graph-programs-")
atexit.register(shutil.rmtree, _PROGRAMS, True)
os.environ["DFLASH_GRAPH_PROGRAMS"] = _PROGRAMS

settings.register_profile("default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def in_repo(monkeypatch):
    """Run with the repository root as the working directory, so messages name paths as users type them."""
    monkeypatch.chdir(ROOT)
    return ROOT
