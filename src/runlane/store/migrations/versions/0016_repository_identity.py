"""Repository identity: every run's repository in its canonical form.

A run's ``repo`` was the task's repository as written, so one repository written four
ways (``https://github.com/acme/app``, ``...app.git``, ``git@github.com:acme/app.git``,
``github.com/acme/app/``) was four concurrency scopes and four strings for the policy
to match. From this revision ``runs.repo`` holds the canonical form
(``domain.repos.canonical_repo``: ``https://github.com/acme/app`` for all four) and
``tasks.repo`` keeps the written one, which the worker clones and the code host is
called with. No column is added: the two already existed, holding the same string.

This brings the rows written before it to that form, in one transaction:

1. ``runs.repo`` of every run whose repository was not canonical (one UPDATE joined to
   a table of the spellings that change, not one scan per spelling), and the
   ``repo:`` key of the concurrency limits in its admission record.
2. The scopes live attempts hold (``attempts.limit_scopes`` of ACTIVE leases):
   ``repo:<spelling>`` becomes ``repo:<canonical>``.
3. The counters: those of the spellings and of their canonical scope become one
   counter of the canonical scope, at the slots the live attempts hold in it (as the
   reconciler counts them) and the maximum of the policy in force (none: no counter).
   Lanes asleep on a spelling's full scope sleep on the canonical one.
4. When a policy is in force and either its repository patterns read differently in
   the canonical form, or a run not yet ended changed its repository, a new policy
   version with the same rules (patterns in the canonical form) is stored: the
   decisions recorded on waiting runs were made on the spelling, and a claim trusts a
   decision of the version in force (PostgreSQL's one-statement claim). Under the new
   version every waiting run is admitted again (the scheduler's first pass, and each
   claim), as after any policy change: a run a rule now matches is denied then.

A local path is resolved (``realpath``) on the machine that runs the upgrade, as a new
task's is where it is submitted. The downgrade leaves the rows as they are: the
canonical form is a repository string an older runlane reads as any other.

Revision ID: 0016
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy import Connection

from runlane.domain.policy import (
    PolicyInvalid,
    policy_digest,
    policy_document,
    policy_from_document,
)
from runlane.domain.repos import canonical_repo
from runlane.domain.states import TERMINAL

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

MOVES = "repo_identity_moves"
ENDED = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL))
SOURCE = "runlane db upgrade 0016: repository patterns and runs in the canonical form"

# The admission record's concurrency limits with the spelling's key renamed, for the
# runs of a spelling that changes (before their repo is: the join is on the spelling).
RENAME_ADMISSION_SCOPE = {
    "postgresql": f"""
UPDATE runs SET admission = CAST(jsonb_set(CAST(runs.admission AS jsonb), '{{concurrency}}',
    (SELECT jsonb_object_agg(CASE WHEN j.key = 'repo:' || m.old_repo
                                  THEN 'repo:' || m.new_repo ELSE j.key END, j.value)
     FROM jsonb_each(CAST(runs.admission AS jsonb) -> 'concurrency') j)) AS json)
FROM {MOVES} m
WHERE runs.repo = m.old_repo
  AND (CAST(runs.admission AS jsonb) -> 'concurrency') ? ('repo:' || m.old_repo)
""",
    "sqlite": f"""
UPDATE runs SET admission = json_set(runs.admission, '$.concurrency',
    (SELECT json_group_object(CASE WHEN j.key = 'repo:' || m.old_repo
                                   THEN 'repo:' || m.new_repo ELSE j.key END, j.value)
     FROM json_each(runs.admission, '$.concurrency') j))
FROM {MOVES} m
WHERE runs.repo = m.old_repo
  AND EXISTS (SELECT 1 FROM json_each(runs.admission, '$.concurrency') j
              WHERE j.key = 'repo:' || m.old_repo)
""",
}
MOVE_RUNS = f"UPDATE runs SET repo = m.new_repo FROM {MOVES} m WHERE runs.repo = m.old_repo"
LIVE_RUN_MOVED = f"""
SELECT 1 FROM runs r JOIN {MOVES} m ON m.old_repo = r.repo
WHERE r.status NOT IN ({ENDED}) LIMIT 1
"""
LIVE_SCOPES = """
SELECT run_id, fencing_token, limit_scopes FROM attempts
WHERE lease_status = 'ACTIVE' AND limit_scopes IS NOT NULL
"""
SET_SCOPES = sa.text("""
UPDATE attempts SET limit_scopes = :scopes
WHERE run_id = :run_id AND fencing_token = :token AND lease_status = 'ACTIVE'
""").bindparams(sa.bindparam("scopes", type_=sa.JSON))


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _policy_in_force(conn: Connection) -> tuple[int, dict[str, Any], Any] | None:
    """(version, stored document, the policy read by this runlane), or None."""
    row = conn.execute(sa.text(
        "SELECT version, document FROM policy_versions ORDER BY version DESC LIMIT 1")).first()
    if row is None:
        return None
    document = _json(row.document)
    try:
        return int(row.version), document, policy_from_document(document)
    except PolicyInvalid:  # not this migration's to judge: the policy is kept as it is
        return None


def _patterns(document: dict[str, Any]) -> list[Any]:
    """The repository patterns of a policy document, as its rules hold them."""
    return ([r.get("match") for r in document.get("repositories") or []]
            + [(r.get("when") or {}).get("repo") for r in document.get("rules") or []])


def upgrade() -> None:
    conn = op.get_bind()
    dialect = conn.dialect.name
    if dialect == "postgresql":  # as a policy change: claims in flight first, none meanwhile
        conn.execute(sa.text("LOCK TABLE attempts IN SHARE ROW EXCLUSIVE MODE"))
    spellings = conn.execute(sa.text("SELECT DISTINCT repo FROM runs")).scalars().all()
    moves = {old: new for old in spellings if (new := canonical_repo(old)) != old}
    live_moved = False
    if moves:
        conn.execute(sa.text(f"CREATE TEMPORARY TABLE {MOVES} (old_repo TEXT PRIMARY KEY, "
                             "new_repo TEXT NOT NULL)"))
        conn.execute(sa.text(f"INSERT INTO {MOVES} (old_repo, new_repo) VALUES (:o, :n)"),
                     [{"o": o, "n": n} for o, n in moves.items()])
        live_moved = conn.execute(sa.text(LIVE_RUN_MOVED)).first() is not None
        conn.execute(sa.text(RENAME_ADMISSION_SCOPE[dialect]))
        conn.execute(sa.text(MOVE_RUNS))
        conn.execute(sa.text(f"DROP TABLE {MOVES}"))
    in_force = _policy_in_force(conn)
    if moves:
        _move_scopes(conn, {f"repo:{o}": f"repo:{n}" for o, n in moves.items()},
                     in_force[2] if in_force else None)
    if in_force is not None:
        version, stored, policy = in_force
        document = policy_document(policy)
        if live_moved or _patterns(document) != _patterns(stored):
            conn.execute(sa.text(
                "INSERT INTO policy_versions (version, digest, document, source, created_at) "
                "VALUES (:version, :digest, :document, :source, :now)"),
                {"version": version + 1, "digest": policy_digest(policy),
                 "document": json.dumps(document), "source": SOURCE, "now": time.time()})


def _move_scopes(conn: Connection, renamed: dict[str, str], policy: Any) -> None:
    """Live attempts' scopes, the counters and the lanes' blocks: each spelling's
    ``repo:`` scope becomes its canonical one."""
    from runlane.store.policy import scope_limit

    held: Counter[str] = Counter()
    updates = []
    for row in conn.execute(sa.text(LIVE_SCOPES)):
        listed = _json(row.limit_scopes) or []
        scopes = sorted({renamed.get(s, s) for s in listed})
        held.update(scopes)
        if scopes != listed:
            updates.append({"scopes": scopes, "run_id": row.run_id, "token": row.fencing_token})
    for start in range(0, len(updates), 1000):
        conn.execute(SET_SCOPES, updates[start:start + 1000])

    targets = sorted(set(renamed.values()))
    involved = sorted(set(renamed) | set(targets))
    counters = {r.scope: int(r.max_active) for r in conn.execute(
        sa.text("SELECT scope, max_active FROM limit_counters WHERE scope IN :scopes")
        .bindparams(sa.bindparam("scopes", expanding=True)), {"scopes": involved})}
    if counters:
        conn.execute(sa.text("DELETE FROM limit_counters WHERE scope IN :scopes")
                     .bindparams(sa.bindparam("scopes", expanding=True)),
                     {"scopes": sorted(counters)})
    merged = []
    for target in targets:
        sources = [s for s in [target, *(o for o, n in renamed.items() if n == target)]
                   if s in counters]
        if not sources:
            continue  # not limited before: a claim makes its counter if it is now
        limit = scope_limit(policy, target) if policy is not None \
            else min(counters[s] for s in sources)
        if limit is not None:
            merged.append({"scope": target, "active": held[target], "max_active": limit})
    if merged:
        conn.execute(sa.text("INSERT INTO limit_counters (scope, active, max_active) "
                             "VALUES (:scope, :active, :max_active)"), merged)

    blocks = conn.execute(
        sa.text("SELECT scope, lane_id FROM lane_blocks WHERE scope IN :scopes")
        .bindparams(sa.bindparam("scopes", expanding=True)), {"scopes": sorted(renamed)}).all()
    if blocks:
        conn.execute(sa.text("DELETE FROM lane_blocks WHERE scope IN :scopes")
                     .bindparams(sa.bindparam("scopes", expanding=True)),
                     {"scopes": sorted(renamed)})
        conn.execute(sa.text(
            "INSERT INTO lane_blocks (scope, lane_id) VALUES (:scope, :lane_id) "
            "ON CONFLICT (scope, lane_id) DO NOTHING"),
            [{"scope": renamed[b.scope], "lane_id": b.lane_id} for b in blocks])


def downgrade() -> None:
    """Nothing to undo: a canonical repository is a repository string to revision 0015."""
