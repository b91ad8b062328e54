"""Hooks for the harness's worker and maintenance processes, installed before the
``runlane`` command runs: ``python -m runlane.chaos.hooks <runlane arguments>``.

* Dwell (``RUNLANE_CHAOS_DWELL`` seconds): a worker lingers in the stage a task's
  prompt names (``dwell=CLAIMED|PREPARING_SANDBOX|FINALIZING``; ``VERIFYING`` is the
  verify command's), so the harness can cancel a run in every stage.
* Pull-request crashes (``RUNLANE_CHAOS_PR_CRASH=1``, the fault ``pr_crash``): a
  worker kills itself (SIGKILL) after the code host opened the pull request of an
  attempt whose task names it (``crash=N``, attempt N), before the ledger records it:
  drill 4, inside the harness. It writes ``chaos_pr_crash`` to its log first, so the
  harness knows the death was planned.
* Planted bugs (``RUNLANE_CHAOS_PLANT``), to show the checks catch them:
  ``no_fencing`` - stores and workers ignore fencing tokens and lease loss;
  ``no_lease_expiry`` - leases never expire and the reaper finds nothing.

Nothing here edits runlane's code: the named statements of ``runlane.store.*_sql`` and
a few methods are replaced in this process only.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from typing import Any

from runlane.chaos.agent import DWELL_ENV, parse_prompt
from runlane.chaos.env import PLANT_ENV, PR_CRASH_ENV, PR_CRASH_MARK

PLANTS = ("no_fencing", "no_lease_expiry")


class PlantFailed(RuntimeError):
    """The statement a planted bug rewrites no longer has the expected shape."""


def _without(statement: str, pattern: str, name: str) -> str:
    rewritten, n = re.subn(pattern, "", statement)
    if n == 0:
        raise PlantFailed(f"planted bug: {name} has no {pattern!r} to remove")
    return rewritten


def plant_no_fencing() -> None:
    from runlane.store import lease_sql, records
    from runlane.worker import attempt

    token = r"\n\s*AND fencing_token = :token"
    lease_sql.SET_RUN_STATUS = _without(lease_sql.SET_RUN_STATUS, token, "SET_RUN_STATUS")
    fenced = lease_sql.SET_RUN_STATUS_FENCED
    fence = getattr(lease_sql, "_FENCE", "")
    if not fence or fence not in fenced:
        raise PlantFailed("planted bug: SET_RUN_STATUS_FENCED has no _FENCE to remove")
    lease_sql.SET_RUN_STATUS_FENCED = _without(fenced.replace(fence, "\n"), token,
                                               "SET_RUN_STATUS_FENCED")
    # The lease's own token, unchecked (the parameter stays bound: the store sends it).
    beat, n = re.subn(r"\n\s*AND attempts\.run_id \|\| [^\n]* IN :lease_keys",
                      "\n  AND (1 = 1 OR attempts.run_id IN :lease_keys)", lease_sql.HEARTBEAT)
    if n == 0:
        raise PlantFailed("planted bug: HEARTBEAT has no lease_keys match to remove")
    for pattern in (r"\n\s*AND attempts\.lease_status = 'ACTIVE'",
                    r"\n\s*AND attempts\.lease_expires_at > \{now\}",
                    r"\n\s*AND attempts\.fencing_token = \(SELECT[^)]*\)"):
        beat = _without(beat, pattern, "HEARTBEAT")
    lease_sql.HEARTBEAT = beat
    lease_sql.EFFECT_DONE = _without(lease_sql.EFFECT_DONE, r"\n\s*AND fencing_token = :token",
                                     "EFFECT_DONE")
    lease_sql.ADD_ATTEMPT_COST = _without(
        _without(lease_sql.ADD_ATTEMPT_COST, r"\n\s*AND lease_status = 'ACTIVE'",
                 "ADD_ATTEMPT_COST"),
        r"\n\s*AND lease_expires_at > \{now\}", "ADD_ATTEMPT_COST")
    _replace(records._Snapshot, "lease_live", property(lambda self: True))

    def extended(self: Any, sent_at: float, ttl: float) -> None:
        self.local_deadline = math.inf

    _replace(attempt.AttemptState, "extended", extended)


def plant_no_lease_expiry() -> None:
    from runlane.store import lease_sql, maintenance_sql, records

    active = "WHERE a.lease_status = 'ACTIVE'"
    if active not in maintenance_sql.EXPIRED_LEASES:
        raise PlantFailed("planted bug: EXPIRED_LEASES changed shape")
    maintenance_sql.EXPIRED_LEASES = maintenance_sql.EXPIRED_LEASES.replace(
        active, "WHERE 1 = 0 AND a.lease_status = 'ACTIVE'")
    lease_sql.HEARTBEAT = _without(lease_sql.HEARTBEAT,
                                   r"\n\s*AND attempts\.lease_expires_at > \{now\}", "HEARTBEAT")
    lease_sql.SET_RUN_STATUS_FENCED = _without(lease_sql.SET_RUN_STATUS_FENCED,
                                               r"\s*AND a\.lease_expires_at > \{now\}",
                                               "SET_RUN_STATUS_FENCED")
    _replace(records._Snapshot, "lease_live", property(
        lambda self: self.lease_status == "ACTIVE" and self.run_token == self.fencing_token))


def _replace(owner: type, name: str, value: object) -> None:
    if not hasattr(owner, name):
        raise PlantFailed(f"planted bug: {owner.__name__}.{name} no longer exists")
    setattr(owner, name, value)


def install_plant(name: str) -> None:
    if name == "no_fencing":
        plant_no_fencing()
    elif name == "no_lease_expiry":
        plant_no_lease_expiry()
    else:
        raise PlantFailed(f"unknown planted bug {name!r}; one of {', '.join(PLANTS)}")


def install_dwell(seconds: float) -> None:
    """Linger ``seconds`` in the stage a task's prompt names."""
    from runlane.domain.states import RunStatus
    from runlane.store.records import Lease
    from runlane.store.store import Store

    get_task, advance = Store.get_task, Store.advance
    dwell_of: dict[str, str | None] = {}

    def get_task_then_dwell(self: Store, task_id: str) -> dict[str, Any]:
        task = get_task(self, task_id)
        behaviour = parse_prompt(str(task.get("prompt", "")))
        dwell_of[task_id] = behaviour.dwell if behaviour else None
        if dwell_of[task_id] == RunStatus.CLAIMED.value:  # the attempt's first read
            time.sleep(seconds)
        return task

    def advance_then_dwell(self: Store, lease: Lease, stage: RunStatus) -> None:
        advance(self, lease, stage)
        if dwell_of.get(lease.task_id) == stage.value:
            time.sleep(seconds)

    Store.get_task = get_task_then_dwell  # type: ignore[method-assign, assignment]
    Store.advance = advance_then_dwell  # type: ignore[method-assign, assignment]


def install_pr_crash() -> None:
    """SIGKILL this worker where drill 4 does (the pull request opened, not recorded),
    for the attempts the tasks name."""
    import signal

    from runlane.store.records import Lease
    from runlane.store.store import Store

    effect_done = Store.effect_done

    def crash_then_effect_done(self: Store, lease: Lease, key: str,
                               result: dict[str, Any]) -> None:
        if key == "pull_request":
            behaviour = parse_prompt(str(self.get_task(lease.task_id).get("prompt", "")))
            if behaviour is not None and behaviour.crash == lease.attempt_no:
                sys.stderr.write(f"{PR_CRASH_MARK} run_id={lease.run_id} "
                                 f"attempt={lease.attempt_no} at={time.time()}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        effect_done(self, lease, key, result)

    Store.effect_done = crash_then_effect_done  # type: ignore[method-assign, assignment]


def install_from_env() -> None:
    plant = os.environ.get(PLANT_ENV)
    if plant:
        install_plant(plant)
    if os.environ.get(PR_CRASH_ENV) == "1":
        install_pr_crash()
    dwell = float(os.environ.get(DWELL_ENV) or 0)
    if dwell > 0:
        install_dwell(dwell)


def main() -> None:
    try:
        install_from_env()
    except PlantFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(70)
    from runlane.cli import main as runlane_main

    runlane_main()


if __name__ == "__main__":
    main()
