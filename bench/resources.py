"""What one sample of the process-tree watch costs (agents/resources.py, issue 22).

The watch reads ``/proc/PID/stat`` of every process on the machine (a process may
belong to the agent's tree through its parent, its group or its session, which only
that file says) and ``/proc/PID/statm`` of the tree's, on every poll of the runner
(50 ms) while one of ``max_processes``, ``max_memory_mb``, ``max_cpu_seconds`` is set.
This starts trees of 1, 10 and 100 sleeping processes, and optionally as many idle
processes outside the tree, and times ``ProcessTree.sample()``; prints Markdown::

    .venv/bin/python bench/resources.py
    .venv/bin/python bench/resources.py --others 1000 --samples 500
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

from runlane.agents.resources import FULL_SCAN_EVERY, ProcessTree


def machine_processes() -> int:
    return sum(1 for entry in os.listdir("/proc") if entry.isdigit())


def tree_of(size: int) -> subprocess.Popen[bytes]:
    """A shell that starts ``size - 1`` sleepers and waits: ``size`` processes."""
    script = f"for i in $(seq {size - 1}); do sleep 600 & done; wait" if size > 1 else "sleep 600"
    return subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True)


def wait_for(tree: ProcessTree, size: int) -> None:
    deadline = time.monotonic() + 60
    while len(tree.sample(memory=False).members) < size:
        if time.monotonic() > deadline:
            raise SystemExit(f"the tree never reached {size} processes")
        time.sleep(0.05)


def timed(tree: ProcessTree, memory: bool, samples: int) -> tuple[list[float], list[float]]:
    """CPU µs of each sample: (the incremental ones, the full scans)."""
    incremental: list[float] = []
    full: list[float] = []
    for _ in range(samples):
        is_full = tree._scans % FULL_SCAN_EVERY == 0
        cpu = time.thread_time()
        tree.sample(memory=memory)
        (full if is_full else incremental).append((time.thread_time() - cpu) * 1e6)
    return incremental, full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--others", type=int, default=0,
                        help="idle processes to start outside the tree first")
    args = parser.parse_args()
    others = tree_of(args.others + 1) if args.others else None
    rows = []
    try:
        if others is not None:
            wait_for(ProcessTree(others.pid), args.others + 1)
        for size in (1, 10, 100):
            proc = tree_of(size)
            try:
                tree = ProcessTree(proc.pid)
                wait_for(tree, size)
                for memory in (False, True):
                    incremental, full = timed(tree, memory, args.samples)
                    on_machine = machine_processes()
                    inc, whole = statistics.median(incremental), statistics.median(full)
                    mean = (inc * (FULL_SCAN_EVERY - 1) + whole) / FULL_SCAN_EVERY
                    rows.append((size, memory, on_machine, inc, whole, whole / on_machine,
                                 mean / 50_000 * 100))
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        if others is not None:
            os.killpg(others.pid, signal.SIGKILL)
            others.wait()
    print(f"`{' '.join(['bench/resources.py', *sys.argv[1:]])}` on {platform.node()} "
          f"({os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"Linux {platform.release()}, load average {os.getloadavg()[0]:.1f}), "
          f"{args.samples} samples each, medians of the CPU time of one sample:\n")
    print("| tree | memory read | processes on the machine | µs, tree and new pids only "
          "| µs, every process (1 in 20) | µs per process, every process "
          "| one core at a 50 ms poll |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for size, memory, on_machine, inc, whole, per, share in rows:
        print(f"| {size} | {'yes' if memory else 'no'} | {on_machine} | {inc:,.0f} "
              f"| {whole:,.0f} | {per:.1f} | {share:.1f} % |")


if __name__ == "__main__":
    main()
