"""runlane.children: a process the worker starts carries SIGKILL-on-parent-death from
before its command runs, without a ``preexec_fn`` (which makes Python fork the whole
worker), and never runs when its worker is already gone.

The end-to-end proof (SIGKILL a worker mid-clone, git dies with it) is in
test_workspace_hardening.py; the agent's, in test_sandbox.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from runlane.children import dying_with_parent

# Prints the calling process's parent-death signal (prctl PR_GET_PDEATHSIG = 2).
PRINT_PDEATHSIG = (
    "import ctypes; v = ctypes.c_int(); "
    "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)")


def test_the_command_runs_with_sigkill_on_parent_death_and_no_preexec_fn() -> None:
    argv, preexec = dying_with_parent([sys.executable, "-c", PRINT_PDEATHSIG])
    assert preexec is None  # setpriv is there (util-linux): Popen keeps its vfork
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == str(int(signal.SIGKILL))
    # The command's own exit status comes through both execs.
    argv, _ = dying_with_parent(["/bin/sh", "-c", "exit 7"])
    assert subprocess.run(argv, timeout=30).returncode == 7


def test_a_command_whose_worker_is_already_gone_never_runs(tmp_path: Path) -> None:
    """The check stands for a worker that died between the spawn and setpriv's prctl:
    the command's parent is then not the pid it was started for (here: made so)."""
    ran = tmp_path / "ran"
    argv, _ = dying_with_parent(["/bin/sh", "-c", f"touch {ran}"])
    worker_pid = argv.index(str(os.getpid()))
    argv[worker_pid] = "1"
    assert subprocess.run(argv, timeout=30).returncode == 137
    assert not ran.exists()
    argv[worker_pid] = str(os.getpid())
    assert subprocess.run(argv, timeout=30).returncode == 0
    assert ran.exists()
