"""SIGTERM starts a worker's drain from a signal handler, which Python runs in the main
thread between two bytecodes: also while that thread is inside ``Listener.wait`` (the
claim loop's idle wait) or writing a log line. The handler must not block on a lock the
interrupted code holds, or the worker never drains (the fault harness: "worker did not
drain within 15s")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import faulthandler, logging, os, signal, sys, threading
    import structlog
    from runlane.store.store import Store
    from runlane.worker.worker import Worker, WorkerConfig

    # INFO on a PrintLogger, as `runlane worker` logs by default: one write lock.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=open(os.devnull, "w")))
    worker = Worker(Store(sys.argv[1]), driver=None, config=WorkerConfig())
    handled = threading.Event()

    def on_sigterm(signum, frame):
        worker._on_signal(signum, frame)
        handled.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    finished = threading.Event()

    def send():  # one SIGTERM at a time; each must be handled
        for _ in range(300):
            worker.draining.clear()
            handled.clear()
            os.kill(os.getpid(), signal.SIGTERM)
            if not handled.wait(5):
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)
        finished.set()

    threading.Thread(target=send, daemon=True).start()
    while not finished.is_set():  # as often as possible inside the wait and a log write
        worker.listener.wait(0)
        worker.log.info("claim_loop_tick")
""")


def test_sigterm_during_the_idle_wait_starts_the_drain(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, f"sqlite:///{tmp_path / 'w.db'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
