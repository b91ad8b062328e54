"""runlane under the peer workload (run in runlane's own venv).

Submit: ``Store.submit`` in batches of TaskSpecs built by ``parse_task`` (built
untimed). Drain: each worker process loops ``Store.claim(limit=B)``, walks every
lease through the stages of a no-op run and completes the claimed batch with one
``Store.complete_many`` (one transaction, set-based fenced statements).
``--stages direct``: claim -> complete (CLAIMED -> FINALIZING -> SUCCEEDED, one
fenced write per batch); ``--stages worker``: the stages a real worker's no-op
attempt takes (PREPARING_SANDBOX, RUNNING, FINALIZING, then SUCCEEDED). Latency: an
idle worker woken by ``runlane.store.wakeup.Listener``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from sqlalchemy import event, text
from sqlalchemy.exc import OperationalError

import runlane
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskSpec, parse_task
from runlane.logs import configure_logging
from runlane.observability import tracing
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store
from runlane.store.wakeup import Listener

REPO = "https://git.example.com/acme/app.git"
QUEUE = "default"
STAGES = {
    "direct": (),
    "worker": (RunStatus.PREPARING_SANDBOX, RunStatus.RUNNING, RunStatus.FINALIZING),
}


def specs(count: int, tag: str) -> list[TaskSpec]:
    return [parse_task({"tenant": f"tenant-{i % 8}", "repo": REPO, "prompt": f"no-op {tag}"})
            for i in range(count)]


def is_locked(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and "locked" in str(exc)


class Counter:
    """Statements and transactions a process sends, from SQLAlchemy's events; with
    ``trace_dir``, also libpq's protocol trace of every connection (PostgreSQL)."""

    def __init__(self, store: Store, trace_dir: str | None, name: str) -> None:
        self.statements = self.rows = self.commits = 0
        self.files: list[Any] = []

        @event.listens_for(store.engine, "before_cursor_execute")
        def _statement(conn: Any, cursor: Any, statement: str, params: Any, context: Any,
                       executemany: bool) -> None:
            self.statements += 1
            self.rows += len(params) if executemany else 1

        @event.listens_for(store.engine, "commit")
        def _commit(conn: Any) -> None:
            self.commits += 1

        if trace_dir and store.is_postgres:
            @event.listens_for(store.engine, "connect")
            def _trace(dbapi_connection: Any, record: Any) -> None:
                from psycopg import pq

                path = Path(trace_dir) / f"{name}-{len(self.files)}.trace"
                handle = path.open("w")
                self.files.append(handle)
                pgconn = dbapi_connection.pgconn
                pgconn.trace(handle.fileno())
                pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)

    def figures(self) -> dict[str, int]:
        for handle in self.files:
            handle.flush()
        return {"statements": self.statements, "statement_rows": self.rows,
                "commits": self.commits}


def observe() -> None:
    """Logs and traces as the environment says (bench/observability.py): the level in
    RUNLANE_LOG_LEVEL (WARNING by default), tracing from OTEL_* as the CLI reads it;
    metrics from RUNLANE_METRICS, which runlane.observability.metrics reads itself."""
    configure_logging(os.environ.get("RUNLANE_LOG_LEVEL", "WARNING"))
    tracing.configure_tracing()


def drain_worker(url: str, batch: int, stages: str, trace_dir: str | None,
                 gate: common.Gate) -> None:
    observe()
    store = Store(url)
    try:
        counter = Counter(store, trace_dir, f"worker{gate.index}")
        with store.engine.connect() as conn:  # connected before the clock starts
            conn.execute(text("SELECT 1"))
        worker_id = f"bench-{os.getpid()}"
        path = STAGES[stages]
        done = errors = locked = 0
        first_error = ""
        marks = [gate.wait()]
        while True:
            try:
                leases = store.claim(worker_id, QUEUE, limit=batch, lease_ttl=60.0)
            except Exception as exc:  # counted, never hidden
                errors += 1
                locked += is_locked(exc)
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                continue
            if not leases:
                break
            walked = []
            for lease in leases:
                # The worker's spans (an attempt and a stage per move; nothing at all
                # unless tracing is configured).
                attempt = tracing.attempt(lease, None)
                try:
                    for stage in path:
                        with attempt.stage(f"runlane.{stage.value.lower()}"):
                            store.advance(lease, stage)
                    walked.append(lease)
                    attempt.end("no_changes")
                except Exception as exc:
                    attempt.end("failed")
                    errors += 1
                    locked += is_locked(exc)
                    first_error = first_error or f"{type(exc).__name__}: {exc}"
            try:
                completion = store.complete_many(walked)
            except Exception as exc:
                errors += len(walked)
                locked += is_locked(exc)
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                continue
            for _, why in completion.refused:
                errors += 1
                first_error = first_error or f"{type(why).__name__}: {why}"
            before = done
            done += len(completion.completed)
            if done // 100 > before // 100:
                marks.append(time.monotonic())
        ended = time.monotonic()
        quarter = max(1, (len(marks) - 1) // 4)  # rates of its first and last quarter
        early = 100 * quarter / (marks[quarter] - marks[0]) if len(marks) > quarter else 0.0
        late = (100 * quarter / (marks[-1] - marks[-1 - quarter])
                if len(marks) > quarter else 0.0)
        gate.report(done, errors=errors, first_error=first_error, ended=ended, locked=locked,
                    rate_first_quarter=early, rate_last_quarter=late, **counter.figures())
    except BaseException as exc:
        gate.crash(exc)
        raise
    finally:
        store.close()


def latency_worker(url: str, poll: float, ready: Any, stop: Any, results: Any,
                   samples: int) -> None:
    configure_logging("WARNING")
    store = Store(url)
    listener = Listener(url).start()
    try:
        listener.wait_connected()
        worker_id = f"bench-latency-{os.getpid()}"
        ready.set()
        while not stop.is_set():
            leases = store.claim(worker_id, QUEUE, limit=1, lease_ttl=60.0)
            for lease in leases:
                common.claimed(results, lease.run_id)
                store.complete(lease)
            if not leases:
                if listener.enabled:
                    listener.wait(poll)
                else:
                    time.sleep(poll)
        common.latency_done(results)
    finally:
        listener.close()
        store.close()


STATEMENT_NAMES = (
    ("WITH picked AS", "claim: CLAIM_BATCH (pick + CAS + token)"),
    ("INSERT INTO attempts", "claim: INSERT_ATTEMPT"),
    ("INSERT INTO run_events", "run_events insert (unnest)"),
    ("UPDATE runs", "SET_RUN_STATUS_FENCED(_MANY)"),
    ("UPDATE attempts", "END_ATTEMPT(S_MANY)"),
    ("SELECT COALESCE", "SELECT now (database clock)"),
)


# Statements of data-modifying CTEs all start alike ("WITH t AS ..."): named by a CTE.
CTE_NAMES = (
    ("won AS (", "complete: COMPLETE_WRITE_PG (CAS + events + attempts ended)"),
    ("claimed AS (", "claim: CLAIM_WRITE_PG (slots + CAS + attempts + events + lanes)"),
    ("full_scopes AS (", "claim: LANE_RUNS"),
)


def statement_name(sql_text: str) -> str:
    flat = " ".join(sql_text.split())
    if flat.startswith("SELECT pg_notify") or flat.upper().startswith("SELECT 1"):
        return flat[:60]
    for cte, name in CTE_NAMES:
        if flat.startswith("WITH") and cte in flat:
            return name
    for prefix, name in STATEMENT_NAMES:
        if flat.startswith(prefix) or f" {prefix}" in flat[:40]:
            return name
    return flat[:60]


def plan_lines(node: dict[str, Any], depth: int = 0) -> list[str]:
    """A compact text rendering of one auto_explain JSON plan node and its children."""
    where = node.get("Relation Name") or node.get("Index Name") or node.get("CTE Name") or ""
    line = (f"{'  ' * depth}{node['Node Type']}{' on ' + where if where else ''}"
            f"  rows={node.get('Actual Rows')} loops={node.get('Actual Loops')}"
            f" time={node.get('Actual Total Time')} ms"
            f" hit={node.get('Shared Hit Blocks', 0)}"
            f" dirtied={node.get('Shared Dirtied Blocks', 0)}")
    extra = [f"{'  ' * (depth + 1)}{key}: {node[key]}"
             for key in ("Index Cond", "Rows Removed by Join Filter", "Rows Removed by Filter")
             if node.get(key)]
    lines = [line, *extra]
    for child in node.get("Plans", []):
        lines += plan_lines(child, depth + 1)
    return lines


def libpq_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def explain(url: str, jobs: int, batch: int, warmup: int, sample: int,
            stats: str) -> dict[str, Any]:
    """Per statement of claim + complete: the server's execution time (auto_explain with
    ANALYZE and BUFFERS, sent back to this session as notices) and the client's time
    around the same execute; plus a SELECT 1 round trip and an empty commit."""
    import re

    store = Store(url)
    notices: list[tuple[str, str]] = []
    collecting = [False]
    tag = ["warm-up"]

    @event.listens_for(store.engine, "connect")
    def _explain(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("LOAD 'auto_explain'")
        for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_analyze = on",
                        "auto_explain.log_buffers = on", "auto_explain.log_timing = on",
                        "auto_explain.log_format = json",
                        "client_min_messages = log"):
            cursor.execute(f"SET {setting}")
        cursor.close()
        dbapi_connection.commit()
        def keep(diag: Any) -> None:
            if collecting[0]:
                notices.append((tag[0], str(diag.message_primary)))

        dbapi_connection.add_notice_handler(keep)

    store.submit(specs(jobs, "explain"))
    store.engine.dispose()  # its backend exits and flushes its counters
    common.prepare_statistics(libpq_dsn(url), stats)
    client: dict[str, list[float]] = {}
    started_at: list[float] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def _before(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        started_at.append(time.perf_counter())

    @event.listens_for(store.engine, "after_cursor_execute")
    def _after(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if collecting[0]:
            client.setdefault(f"{tag[0]}|{statement_name(statement)}", []).append(
                time.perf_counter() - started_at[-1])

    def auto_explain(on: bool) -> None:
        with store.engine.connect() as conn:
            conn.exec_driver_sql(
                f"SET auto_explain.log_min_duration = {0 if on else -1}")
            conn.commit()

    # Sample the first runs (after a warm-up) and the last ones: the plans and timings
    # as the queue drains, without logging every statement of the whole drain.
    phases: dict[str, int] = {}
    cycles = claimed = 0
    phase = "warm-up"
    auto_explain(False)
    while True:
        if phase == "warm-up" and cycles >= warmup:
            phase = "first"
            auto_explain(True)
        elif phase == "first" and phases.get("first", 0) >= sample:
            phase = "middle"
            auto_explain(False)
        remaining = jobs - claimed
        if phase == "middle" and remaining <= sample:
            phase = "last"
            auto_explain(True)
        collecting[0] = phase in ("first", "last")
        tag[0] = phase
        leases = store.claim("explain", QUEUE, limit=batch, lease_ttl=60.0)
        if not leases:
            break
        store.complete_many(leases)
        claimed += len(leases)
        phases[phase] = phases.get(phase, 0) + len(leases)
        cycles += 1
    collecting[0] = False
    server: dict[str, list[float]] = {}
    plans: dict[str, str] = {}
    for phase_name, message in notices:
        found = re.search(r"duration: ([\d.]+) ms\s+plan:\s*(\{.*\})\s*$", message, re.S)
        if not found:
            continue
        plan = json.loads(found.group(2))
        name = f"{phase_name}|{statement_name(plan['Query Text'])}"
        server.setdefault(name, []).append(float(found.group(1)) / 1000.0)
        if name not in plans or len(plans[name]) < 20:
            plans[name] = "\n".join(plan_lines(plan["Plan"]))
    floor: dict[str, list[float]] = {"select1": [], "commit": []}
    with store.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.rollback()
        raw.autocommit = True
        # A logged table (a temp table's commit would not flush the WAL).
        raw.execute("CREATE TABLE bench_floor_probe (i int)")
        for i in range(220):
            t0 = time.perf_counter()
            raw.execute("SELECT 1").fetchone()
            t1 = time.perf_counter()
            with raw.transaction():
                raw.execute("INSERT INTO bench_floor_probe VALUES (%s)", (i,))
            t2 = time.perf_counter()
            if i >= 20:
                floor["select1"].append(t1 - t0)
                floor["commit"].append(t2 - t1)
        raw.execute("DROP TABLE bench_floor_probe")
        raw.autocommit = False
    store.close()
    return {
        "runs": claimed, "batch": batch, "sampled": phases,
        "statements": {
            name: {"client_calls": len(client.get(name, [])),
                   "server_executions": len(server.get(name, [])),
                   "server_p50_ms": common.percentile(server.get(name, []), 50) * 1000,
                   "client_p50_ms": common.percentile(client.get(name, []), 50) * 1000,
                   "plan": plans.get(name, "")}
            for name in sorted(set(server) | set(client))
        },
        "select1_p50_ms": common.percentile(floor["select1"], 50) * 1000,
        "commit_p50_ms": common.percentile(floor["commit"], 50) * 1000,
    }


def main() -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else "runlane")
    p.add_argument("--stages", choices=sorted(STAGES), default="direct")
    p.add_argument("--trace-dir", help="write libpq protocol traces of the workers here")
    p.add_argument("--poll", type=float, default=1.0,
                   help="the latency worker's poll interval (the fallback under LISTEN)")
    p.add_argument("--skip-migrate", action="store_true")
    p.add_argument("--explain", action="store_true",
                   help="only the per-statement profile of claim + complete (one process)")
    args = p.parse_args()
    configure_logging("WARNING")
    url = args.dsn
    if not args.skip_migrate:
        engine = build_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
    if args.explain:
        common.emit(explain(url, args.jobs, args.claim_batch, warmup=5, sample=200,
                            stats=args.stats))
        return 0
    store = Store(url)
    try:
        store.submit(specs(10, "warm-up"))
        with store.engine.begin() as conn:  # the warm-up runs are not part of the drain
            for table in ("run_events", "runs", "tasks", "lanes"):  # lanes: their counts
                conn.execute(text(f"DELETE FROM {table}"))
        todo = specs(args.jobs, "drain")
        enqueue = common.timed_batches(lambda lo, hi: store.submit(todo[lo:hi]), args.jobs,
                                       args.submit_batch)
    finally:
        store.close()
    analyzed = common.prepare_statistics(libpq_dsn(url), args.stats) if "postgres" in url \
        else []

    result = common.drain(drain_worker, (url, args.claim_batch, args.stages, args.trace_dir),
                          args.concurrency, common.database_name(url), args.jobs)
    figures: dict[str, Any] = {
        "system": "runlane" if args.stages == "direct" else f"runlane ({args.stages} stages)",
        "version": runlane.__version__ if hasattr(runlane, "__version__") else "working tree",
        "driver": "psycopg (SQLAlchemy)", "enqueue": enqueue, "drain": result.as_dict(),
        "analyzed": analyzed,
    }
    if args.latency_samples:
        probe = common.LatencyProbe(latency_worker, (url, args.poll),
                                    args.latency_samples).start()
        store = Store(url)
        try:
            one = specs(args.latency_samples, "latency")
            for spec in one:
                started = time.monotonic()
                submission = store.submit([spec])[0]
                probe.mark(submission.run_id, started, time.monotonic())
                time.sleep(args.latency_interval)
        finally:
            store.close()
        figures["latency"] = probe.finish()
    figures["audit"] = audit(url)
    common.emit(figures)
    return 0


def audit(url: str) -> dict[str, Any]:
    """``Store.audit()`` on the database the benchmark left: speed must not have cost
    an invariant (issue 5)."""
    store = Store(url)
    try:
        started = time.monotonic()
        found = store.audit()
        return {"violations": len(found), "seconds": time.monotonic() - started,
                "first": f"{found[0].check}: {found[0].detail}" if found else ""}
    finally:
        store.close()


if __name__ == "__main__":
    raise SystemExit(main())
