"""What the harness tells the worker processes it starts through ``runlane.chaos.hooks``
(environment variables) and what they write back to their logs: shared here so that
the harness need not import the hooks, which run runlane's CLI."""

from __future__ import annotations

PLANT_ENV = "RUNLANE_CHAOS_PLANT"
PR_CRASH_ENV = "RUNLANE_CHAOS_PR_CRASH"
PR_CRASH_MARK = "chaos_pr_crash"
