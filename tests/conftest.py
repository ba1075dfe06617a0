import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


LAUNCH_LOCK = os.path.join(tempfile.gettempdir(), "autopar-tests-launch.lock")


@pytest.fixture(autouse=True)
def one_launch_at_a_time(request):
    """Tests marked ``launch`` start gloo ranks; each holds a lock file while
    it runs, so the pytest-xdist workers (pyproject's addopts: each test file
    on one worker) never run two launches at once: two 4-rank launches on 2
    cores can starve a rank until gloo drops it."""
    if request.node.get_closest_marker("launch") is None:
        yield
        return
    with open(LAUNCH_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Signs that a rank process died underneath gloo (seen only when the 2-core
# machine was overloaded by several launches at once), not that autopar failed.
LOST_RANK = ("terminate called without an active exception", "Connection reset by peer")


def torchrun(args: list, nproc: int, timeout: int = 600, extra: list | None = None) -> subprocess.CompletedProcess:
    """Launch ``args`` (a script path or ['-m', module, ...]) on nproc local gloo ranks.
    A launch that lost a rank process is run once more; any other failure stands."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), *(extra or []), *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode == 0 or not any(sign in proc.stderr for sign in LOST_RANK) or attempt:
            return proc
    return proc


def first_error(stderr: str) -> str:
    """The first rank's traceback (later ranks often only report a lost peer)."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback" in line), None)
    return "\n".join(lines[start:start + 60]) + "\n...\n" if start is not None else ""


def verify(source: str | list, mesh: str, nproc: int, tmp_path, *, cluster: str = "tests/fixtures/fastnet.json",
           random_plans: int = 1, extra: list | None = None) -> list:
    """Reports of `python -m autopar.verify` on one model or several (one launch)."""
    out = tmp_path / "report.json"
    sources = [source] if isinstance(source, str) else source
    proc = torchrun(["-m", "autopar.verify", *sources, "--mesh", mesh, "--cluster", cluster,
                     "--random-plans", str(random_plans), "--json", str(out), *(extra or [])], nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + first_error(proc.stderr) + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture
def root():
    return ROOT
