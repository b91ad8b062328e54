"""Raw SQL baselines under the peer workload (run in the peer venv; psycopg 3, sync,
autocommit: every statement is its own transaction and its own round trip).

``--shape minimal``: a one-table queue, the floor. Claim: one ``UPDATE ... WHERE id IN
(SELECT ... FOR UPDATE SKIP LOCKED LIMIT B) RETURNING``; complete: one UPDATE per job.

``--shape runlane`` and ``--shape runlane-batch``: a prototype, not runlane code, on a
database migrated by runlane (the orchestrator migrates it): the rows every runlane
claim and completion must write, and nothing else: the run's compare-and-set with its
fencing token, an attempt with its lease, one event per hop, the lease fence on
completion; each claim ONE statement with data-modifying CTEs, walking one lane
(``ix_runs_lane_dispatch``, the tenants' lanes in turn). No scheduling: no lane counts
or passes written, no limit counters, no policy, no Python per run beyond the loop.
It is the floor of runlane's data model under this workload, what the schema and the
invariants cost with the fewest round trips. ``runlane`` completes each run in its own
statement, its queue populated with set-based SQL; ``runlane-batch`` completes a
claimed batch in one, and enqueues from the client in batches, one statement each
(the task, run and event rows; ids made by the client; no admission, lane counts or
idempotency keys): the submit floor.
"""

from __future__ import annotations

import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import psycopg

NOW = "CAST(EXTRACT(EPOCH FROM now()) AS double precision)"

MINIMAL_SCHEMA = """
CREATE TABLE IF NOT EXISTS raw_jobs (
    id bigserial PRIMARY KEY,
    status text NOT NULL DEFAULT 'queued',
    priority integer NOT NULL DEFAULT 0,
    payload jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    claimed_at timestamptz,
    finished_at timestamptz
);
CREATE INDEX IF NOT EXISTS raw_jobs_queued ON raw_jobs (priority, id) WHERE status = 'queued';
"""
MINIMAL_ENQUEUE = "INSERT INTO raw_jobs (priority) SELECT unnest(%s::int[]) RETURNING id"
MINIMAL_CLAIM = """
UPDATE raw_jobs SET status = 'running', claimed_at = now()
WHERE id IN (SELECT id FROM raw_jobs WHERE status = 'queued'
             ORDER BY priority, id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id
"""
MINIMAL_COMPLETE = ("UPDATE raw_jobs SET status = 'done', finished_at = now() "
                    "WHERE id = %s AND status = 'running'")

RUNLANE_POPULATE = f"""
WITH l AS (
    INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                       tenant_at_limit)
    SELECT 'default', '', 100, 'tenant-' || i, 1.0, 0, 0, 0 FROM generate_series(0, 7) i
    RETURNING lane_id, tenant
), t AS (
    INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, idempotency_key,
                       max_attempts, context, truncated_sections, payload_bytes,
                       cancel_requested_at, created_at)
    SELECT gen_random_uuid()::text, 'tenant-' || mod(g, 8), 'https://git.example.com/a.git',
           'no-op', 'default', 100, NULL, 3, '{{}}'::json, '[]'::json, 120, NULL,
           {NOW} + g * 1e-6
    FROM generate_series(1, %(n)s) AS g
    RETURNING task_id, tenant, repo, queue, priority, created_at
), r AS (
    INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, attempt_count,
                      max_attempts, fencing_token, visible_at, created_at, updated_at,
                      cost_usd, lane_id, policy_version)
    SELECT gen_random_uuid()::text, t.task_id, t.tenant, t.repo, t.queue, t.priority,
           'QUEUED', 0, 3, 0, t.created_at, t.created_at, t.created_at, 0, l.lane_id, 0
    FROM t JOIN l ON l.tenant = t.tenant
    RETURNING run_id, created_at
)
INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status, reason_code,
                        fencing_token, message)
SELECT run_id, NULL, created_at, 'api', NULL, 'QUEUED', NULL, NULL, 'submitted' FROM r
"""
RUNLANE_LANES = "SELECT lane_id FROM lanes ORDER BY lane_id"
RUNLANE_LANES_CREATE = """
INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                   tenant_at_limit)
SELECT 'default', '', 100, 'tenant-' || i, 1.0, 0, 0, 0 FROM generate_series(0, 7) i
"""
# The submit floor: a batch's task, run and event rows from the client, one statement
# (ids made by the client, as runlane's are); no admission, lanes or idempotency.
RUNLANE_SUBMIT = f"""
WITH b AS (
    SELECT b.*, {NOW} + b.n * 1e-6 AS created_at
    FROM unnest(%(task_ids)s::text[], %(run_ids)s::text[], %(tenants)s::text[],
                %(lanes)s::integer[]) WITH ORDINALITY AS b(task_id, run_id, tenant, lane_id, n)
), t AS (
    INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, idempotency_key,
                       max_attempts, context, truncated_sections, payload_bytes,
                       cancel_requested_at, created_at)
    SELECT b.task_id, b.tenant, 'https://git.example.com/a.git', 'no-op', 'default', 100,
           NULL, 3, '{{}}'::json, '[]'::json, 120, NULL, b.created_at
    FROM b
), r AS (
    INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, attempt_count,
                      max_attempts, fencing_token, visible_at, created_at, updated_at,
                      cost_usd, lane_id, policy_version)
    SELECT b.run_id, b.task_id, b.tenant, 'https://git.example.com/a.git', 'default', 100,
           'QUEUED', 0, 3, 0, b.created_at, b.created_at, b.created_at, 0, b.lane_id, 0
    FROM b
)
INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status, reason_code,
                        fencing_token, message)
SELECT b.run_id, NULL, b.created_at, 'api', NULL, 'QUEUED', NULL, NULL, 'submitted' FROM b
"""
RUNLANE_CLAIM = f"""
WITH picked AS (
    SELECT r.run_id FROM runs r
    WHERE r.lane_id = %(lane)s AND r.status = 'QUEUED' AND r.visible_at <= {NOW}
      AND (SELECT t.cancel_requested_at FROM tasks t WHERE t.task_id = r.task_id) IS NULL
    ORDER BY r.created_at, r.run_id
    LIMIT %(limit)s
    FOR UPDATE OF r SKIP LOCKED
), claimed AS (
    UPDATE runs SET status = 'CLAIMED', fencing_token = runs.fencing_token + 1,
                    attempt_count = runs.attempt_count + 1, updated_at = {NOW}
    FROM picked WHERE runs.run_id = picked.run_id AND runs.status = 'QUEUED'
    RETURNING runs.run_id, runs.fencing_token, runs.attempt_count
), leased AS (
    INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status, lease_status,
                          lease_expires_at, heartbeat_at, started_at, cost_usd, input_tokens,
                          output_tokens)
    SELECT run_id, attempt_count, fencing_token, %(worker)s, 'RUNNING', 'ACTIVE',
           {NOW} + %(ttl)s, {NOW}, {NOW}, 0, 0, 0 FROM claimed
), logged AS (
    INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                            reason_code, fencing_token, message)
    SELECT run_id, attempt_count, {NOW}, %(worker)s, 'QUEUED', 'CLAIMED', NULL,
           fencing_token, NULL FROM claimed
)
SELECT run_id, fencing_token, attempt_count FROM claimed
"""
# Complete the runs whose (run_id, token) pairs are given: CLAIMED -> FINALIZING ->
# SUCCEEDED, fenced on the live lease, the attempt ended, one event per hop.
RUNLANE_COMPLETE = f"""
WITH lease AS (
    SELECT * FROM unnest(%(run_ids)s::text[], %(tokens)s::bigint[]) AS l(run_id, token)
), done AS (
    UPDATE runs SET status = 'SUCCEEDED', updated_at = {NOW}, outcome = 'succeeded',
                    ended_at = COALESCE(runs.ended_at, {NOW})
    FROM lease
    WHERE runs.run_id = lease.run_id AND runs.status IN ('CLAIMED')
      AND runs.fencing_token = lease.token
      AND EXISTS (SELECT 1 FROM attempts a
                  WHERE a.run_id = runs.run_id AND a.fencing_token = lease.token
                    AND a.lease_status = 'ACTIVE' AND a.lease_expires_at > {NOW})
    RETURNING runs.run_id, runs.fencing_token, runs.attempt_count
), ended AS (
    UPDATE attempts SET status = 'SUCCEEDED', lease_status = 'RELEASED',
                        lease_ended_at = COALESCE(attempts.lease_ended_at, {NOW}),
                        ended_at = {NOW}
    FROM done
    WHERE attempts.run_id = done.run_id AND attempts.fencing_token = done.fencing_token
      AND attempts.ended_at IS NULL
), logged AS (
    INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                            reason_code, fencing_token, message)
    SELECT done.run_id, done.attempt_count, {NOW}, %(worker)s, hop.source, hop.target, NULL,
           done.fencing_token, NULL
    FROM done CROSS JOIN (VALUES (1, 'CLAIMED', 'FINALIZING'),
                                 (2, 'FINALIZING', 'SUCCEEDED')) AS hop(n, source, target)
    ORDER BY done.run_id, hop.n
)
SELECT run_id FROM done
"""


def connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def drain_worker(dsn: str, shape: str, batch: int, gate: common.Gate) -> None:
    try:
        with connect(dsn) as conn:
            lanes = ([] if shape == "minimal"
                     else [r[0] for r in conn.execute(RUNLANE_LANES)])
            turn = gate.index
            worker = f"raw-{gate.index}"
            done = errors = statements = 0
            gate.wait()
            while True:
                if shape == "minimal":
                    statements += 1
                    ids = [r[0] for r in conn.execute(MINIMAL_CLAIM, (batch,), prepare=True)]
                    if not ids:
                        break
                    for job_id in ids:
                        statements += 1
                        conn.execute(MINIMAL_COMPLETE, (job_id,), prepare=True)
                        done += 1
                    continue
                rows = []
                while lanes and not rows:  # the lanes in turn; an empty one is dropped
                    lane = lanes[turn % len(lanes)]
                    turn += 1
                    statements += 1
                    rows = conn.execute(RUNLANE_CLAIM, {"lane": lane, "limit": batch,
                                                        "worker": worker, "ttl": 60.0},
                                        prepare=True).fetchall()
                    if not rows:
                        lanes.remove(lane)
                if not rows:
                    break
                groups = [rows] if shape == "runlane-batch" else [[row] for row in rows]
                for group in groups:
                    statements += 1
                    won = conn.execute(RUNLANE_COMPLETE, {
                        "run_ids": [r[0] for r in group], "tokens": [r[1] for r in group],
                        "worker": worker}, prepare=True).fetchall()
                    done += len(won)
                    errors += len(group) - len(won)
            gate.report(done, errors=errors, ended=time.monotonic(), statements=statements)
    except BaseException as exc:
        gate.crash(exc)
        raise


def latency_worker(dsn: str, ready: Any, stop: Any, results: Any, samples: int) -> None:
    with connect(dsn) as listen, connect(dsn) as conn:
        listen.execute("LISTEN raw_jobs")
        ready.set()
        while not stop.is_set():
            ids = [r[0] for r in conn.execute(MINIMAL_CLAIM, (1,), prepare=True)]
            for job_id in ids:
                common.claimed(results, job_id)
                conn.execute(MINIMAL_COMPLETE, (job_id,), prepare=True)
            if not ids:
                for _ in listen.notifies(timeout=1.0, stop_after=1):
                    pass
        common.latency_done(results)


def main() -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else "raw")
    p.add_argument("--shape", choices=("minimal", "runlane", "runlane-batch"),
                   default="minimal")
    args = p.parse_args()
    enqueue: dict[str, Any] | None = None
    with connect(args.dsn) as conn:
        if args.shape == "minimal":
            conn.execute(MINIMAL_SCHEMA)
            enqueue = common.timed_batches(
                lambda lo, hi: conn.execute(MINIMAL_ENQUEUE, ([0] * (hi - lo),)),
                args.jobs, args.submit_batch)
        elif args.shape == "runlane-batch":  # the submit floor too, batch by batch
            conn.execute(RUNLANE_LANES_CREATE)
            lanes = [r[0] for r in conn.execute(RUNLANE_LANES)]

            def submit(lo: int, hi: int) -> None:
                conn.execute(RUNLANE_SUBMIT, {
                    "task_ids": [str(uuid.uuid4()) for _ in range(lo, hi)],
                    "run_ids": [str(uuid.uuid4()) for _ in range(lo, hi)],
                    "tenants": [f"tenant-{i % 8}" for i in range(lo, hi)],
                    "lanes": [lanes[i % 8] for i in range(lo, hi)]}, prepare=True)

            enqueue = common.timed_batches(submit, args.jobs, args.submit_batch)
        else:
            conn.execute(RUNLANE_POPULATE, {"n": args.jobs})
    analyzed = common.prepare_statistics(args.dsn, args.stats)
    result = common.drain(drain_worker, (args.dsn, args.shape, args.claim_batch),
                          args.concurrency, common.database_name(args.dsn), args.jobs)
    names = {"minimal": "raw SQL (one table)",
             "runlane": "runlane schema, 1 statement per claim and per complete",
             "runlane-batch": "runlane schema, 1 statement per claim and per batch complete"}
    figures: dict[str, Any] = {"system": names[args.shape], "version": "-",
                               "driver": f"psycopg {version('psycopg')}",
                               "drain": result.as_dict(), "analyzed": analyzed}
    if enqueue is not None:
        figures["enqueue"] = enqueue
    if args.latency_samples and args.shape == "minimal":
        probe = common.LatencyProbe(latency_worker, (args.dsn,), args.latency_samples).start()
        with connect(args.dsn) as conn:
            for _ in range(args.latency_samples):
                started = time.monotonic()
                with conn.transaction():
                    row = conn.execute(
                        "INSERT INTO raw_jobs (priority) VALUES (0) RETURNING id").fetchone()
                    job_id = row[0] if row else None
                    conn.execute("NOTIFY raw_jobs")
                probe.mark(job_id, started, time.monotonic())
                time.sleep(args.latency_interval)
        figures["latency"] = probe.finish()
    common.emit(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
