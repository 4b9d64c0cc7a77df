"""The session-level check of tests/leaks.py, on a pytest session of its own: a test that leaves a
child process running fails the session, which names and kills it; reaped children, and the
pytest process itself, pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.leaks import _stat, descendants

ROOT = Path(__file__).resolve().parent.parent

LEAKY = """
import subprocess, sys
def test_leaks():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # leaked-child"])
    open("pid", "w").write(str(proc.pid))
"""

TIDY = """
import subprocess, sys
def test_reaps():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    proc.kill()
    proc.wait()
"""


def run_session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_it.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.leaks", "-c", os.devnull, "test_it.py"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_leaked_child_fails_the_session_and_is_killed(tmp_path):
    r = run_session(tmp_path, LEAKY)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "outlived the session" in r.stdout and "leaked-child" in r.stdout, r.stdout
    pid = int((tmp_path / "pid").read_text())
    st = _stat(pid)
    assert st is None or st[1] == "Z", st  # gone, or dead and not yet reaped by init


def test_reaped_children_pass(tmp_path):
    r = run_session(tmp_path, TIDY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outlived" not in r.stdout


def test_descendants_of_this_process_do_not_include_itself():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        kids = descendants(os.getpid())
        assert proc.pid in kids and os.getpid() not in kids
    finally:
        proc.kill()
        proc.wait()
