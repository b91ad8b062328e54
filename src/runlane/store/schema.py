"""The database schema: tasks, runs, attempts (each carrying its lease), events, workers.

Design choices, each keeping every invariant of runlane while making a claim
cheaper (issue 2 allows both merges):

* The queue item lives in the run row. A run is deliverable exactly when its
  status is QUEUED and ``visible_at`` has passed, so a run has at most one
  active delivery by construction (its primary key), and a terminal run can
  never keep a live one.
* The lease lives in the attempt row (``lease_status``, ``lease_expires_at``,
  ``fencing_token``). A partial unique index allows at most one ACTIVE lease
  per run; expired and released leases stay as history.
* Times are seconds since the Unix epoch (double precision). Every expiry is
  computed in SQL from the database clock, or from a ``now`` the caller pins.
* The hot tables (``runs``, ``attempts``, ``run_events``) carry no foreign keys
  (migration 0007). Every row of them is written in the statement or transaction
  that writes or CAS-updates its parent, and retention deletes children first; a
  foreign key re-checked that per row, in a trigger query: 9% of the server's
  time in the peer drain. ``runlane audit`` reports any
  orphan (``run_without_task``, ``attempt_without_run``, ``event_without_run``).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

metadata = MetaData()

ID = String(36)
Timestamp = Float  # epoch seconds, see module docstring
EventId = BigInteger().with_variant(Integer(), "sqlite")
IDEMPOTENCY_INDEX_NAME = "uq_tasks_tenant_idempotency_key_partial"
IDEMPOTENCY_INDEX_WHERE = "idempotency_key IS NOT NULL"
FAILURE_EVENTS_WHERE = "to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED')"
CLAIM_EVENTS_WHERE = "to_status = 'CLAIMED'"
# Attempts that ended a run's try in failure (0028): `runlane top`'s latest failures.
FAILED_ENDS_WHERE = "end_to_status IN ('FAILED_RETRYABLE', 'FAILED')"

tasks = Table(
    "tasks",
    metadata,
    Column("task_id", ID, primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("repo", Text, nullable=False),
    Column("prompt", Text, nullable=False),
    Column("queue", String(128), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("idempotency_key", String(255)),
    Column("max_attempts", Integer, nullable=False),
    Column("context", JSON, nullable=False),
    Column("truncated_sections", JSON, nullable=False),
    Column("payload_bytes", Integer, nullable=False),
    Column("cancel_requested_at", Timestamp),
    Column("created_at", Timestamp, nullable=False),
    # Added by 0004 (the scheduler): who asked, what the run needs, its lineage.
    Column("user_id", String(128)),
    Column("requires", Text, nullable=False, server_default=text("''")),  # canonical route key
    Column("parent_task_id", ID),
    Column("estimated_cost_usd", Float),
    # Added by 0019: the SHA-256 of the task as asked (domain/tasks.py:task_digest),
    # for tasks with an idempotency key only: the same key with another digest is a
    # conflict. NULL on tasks submitted before 0019: taken as matching.
    Column("request_digest", String(64)),
    # Added by 0022: the W3C traceparent of the submit's span (observability/tracing.py);
    # the task's attempts join that trace. NULL when the submit traced nothing.
    Column("traceparent", String(128)),
    # One task per (tenant, idempotency key); a task without a key has no entry, so an
    # unkeyed submit writes none (migration 0015). The submit's ON CONFLICT names the
    # predicate (submit_sql.SUBMIT_WRITE_PG, Store._write_submission).
    Index(IDEMPOTENCY_INDEX_NAME, "tenant", "idempotency_key", unique=True,
          postgresql_where=text(IDEMPOTENCY_INDEX_WHERE),
          sqlite_where=text(IDEMPOTENCY_INDEX_WHERE)),
    # Retention keeps a task another names as its parent (migration 0011).
    Index("ix_tasks_parent", "parent_task_id",
          postgresql_where=text("parent_task_id IS NOT NULL"),
          sqlite_where=text("parent_task_id IS NOT NULL")),
)

# A task waits for these tasks to succeed before its run is queued.
task_dependencies = Table(
    "task_dependencies",
    metadata,
    Column("task_id", ID, ForeignKey("tasks.task_id"), primary_key=True),
    Column("depends_on", ID, ForeignKey("tasks.task_id"), primary_key=True),
    Index("ix_task_dependencies_depends_on", "depends_on"),
)

runs = Table(
    "runs",
    metadata,
    Column("run_id", ID, primary_key=True),
    Column("task_id", ID, nullable=False),  # tasks.task_id; no foreign key: see above
    Column("tenant", String(128), nullable=False),
    Column("repo", Text, nullable=False),
    Column("queue", String(128), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("status", String(32), nullable=False),
    Column("attempt_count", Integer, nullable=False, server_default="0"),
    Column("max_attempts", Integer, nullable=False),
    # The token of the newest lease; every new lease of this run takes token + 1.
    Column("fencing_token", BigInteger, nullable=False, server_default="0"),
    Column("visible_at", Timestamp, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Column("ended_at", Timestamp),
    Column("reason_code", String(64)),
    Column("message", Text),
    Column("outcome", String(64)),
    Column("cost_usd", Float, nullable=False, server_default="0"),
    # Added by 0004 (the scheduler): the admission record and what the claim needs.
    Column("user_id", String(128)),
    Column("risk_class", String(64), nullable=False, server_default=text("''")),
    Column("route_key", Text, nullable=False, server_default=text("''")),
    Column("lane_id", Integer),
    Column("policy_version", Integer, nullable=False, server_default="0"),
    Column("admission", JSON),  # the decision, as recorded at admission
    Column("limits", JSON),  # per-run limits snapshot (cost, wall clock, files, lines)
    Column("estimated_cost_usd", Float),
    # Added by 0018 (pull-request evidence): attempts numbered above it are
    # finalize-only, outside the attempt budget (NULL: none granted); and when a
    # worker is due to close the pull request of a run that ended without success.
    Column("finalize_only_after", Integer),
    Column("close_due_at", Timestamp),
    # Added by 0019: the run this one retries (``runlane retry``), a finished run of the
    # same task; NULL for a task's first run.
    Column("retry_of_run_id", ID),
    # Added by 0025: when the run's cost limit (max_cost_usd) was crossed; NULL: never.
    Column("cost_exceeded_at", Timestamp),
    # Added by 0026 (provider capacity): the model provider the run uses, as admission
    # resolved it (the task's own, else its queue's default in the policy); NULL: none.
    # An attempt holds a slot in the scope ``provider:NAME`` (domain.policy.run_scopes).
    Column("provider", String(128)),
    # Added by 0028 (leaner rows per run): a run created QUEUED writes no event, its row
    # is the record of its creation (store/history.py): who submitted it, and its place
    # in the event stream (the writer's transaction id on PostgreSQL, 0 on SQLite, and a
    # position taken from run_events' ids). NULL for a run whose creation is an event.
    Column("created_by", String(255)),
    Column("created_tx", BigInteger),
    Column("created_seq", BigInteger),
    Index("ix_runs_task_id", "task_id"),
    # The runs listing (migration 0020, store/listing.py): a page is a walk of one of
    # these from its cursor, newest or oldest first, never a sort.
    Index("ix_runs_listing_tenant_status", "tenant", "status", "created_at", "run_id"),
    Index("ix_runs_listing_tenant", "tenant", "created_at", "run_id"),
    Index("ix_runs_listing", "created_at", "run_id"),
    Index("ix_runs_status_updated", "status", "updated_at"),
    # The scheduler pass pages through waiting runs with a keyset on (created_at, id).
    Index("ix_runs_waiting", "status", "created_at", "run_id",
          postgresql_where=text("status IN ('ADMITTED', 'WAITING_CAPACITY')"),
          sqlite_where=text("status IN ('ADMITTED', 'WAITING_CAPACITY')")),
    # Runs whose pull request a worker is due to close (0018): no entry otherwise.
    Index("ix_runs_close_due", "close_due_at",
          postgresql_where=text("close_due_at IS NOT NULL"),
          sqlite_where=text("close_due_at IS NOT NULL")),
    # A run is retried at most once (0019): two retries racing on the same finished
    # run cannot both insert; the loser changes nothing. No entry for a first run.
    Index("uq_runs_retry_of", "retry_of_run_id", unique=True,
          postgresql_where=text("retry_of_run_id IS NOT NULL"),
          sqlite_where=text("retry_of_run_id IS NOT NULL")),
    # The event stream's creations (0028, store/events.py): no entry for a run whose
    # creation is an event.
    Index("ix_runs_created_feed", "created_tx", "created_seq",
          postgresql_where=text("created_seq IS NOT NULL"),
          sqlite_where=text("created_seq IS NOT NULL")),
)

# The dispatch index (migration 0004, through the online-index guard; it replaced
# 0002's ``ix_runs_dispatch``). A lane is one (queue, route, priority, tenant); the
# claim picks lanes fairly from ``lanes`` and then walks this index inside each
# lane, oldest first, so it reads about as many entries as it takes runs.
DISPATCH_INDEX_NAME = "ix_runs_lane_dispatch"
DISPATCH_INDEX_COLUMNS = ("lane_id", "created_at", "run_id")
DISPATCH_INDEX_WHERE = "status = 'QUEUED'"
Index(
    DISPATCH_INDEX_NAME,
    *(runs.c[name] for name in DISPATCH_INDEX_COLUMNS),
    postgresql_where=text(DISPATCH_INDEX_WHERE),
    sqlite_where=text(DISPATCH_INDEX_WHERE),
)

# Lanes: the unit of fair sharing. ``queued_count`` says whether a lane has work;
# ``pass`` is its stride-scheduling virtual time (advanced by 1/weight per claim);
# ``tenant_at_limit`` hides every lane of a tenant that holds all its slots, so a
# full tenant's backlog is never scanned by a claim; ``wake_at`` hides a lane whose
# runs all wait for their backoff; ``unserved`` marks a lane no live worker serves.
lanes = Table(
    "lanes",
    metadata,
    Column("lane_id", Integer, primary_key=True, autoincrement=True),
    Column("queue", String(128), nullable=False),
    Column("route_key", Text, nullable=False),
    Column("priority", Integer, nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("weight", Float, nullable=False, server_default="1"),
    Column("queued_count", Integer, nullable=False, server_default="0"),
    Column("pass", Float, nullable=False, server_default="0"),
    Column("tenant_at_limit", Integer, nullable=False, server_default="0"),
    # Set while every queued run of the lane waits for its backoff: the lane is out of
    # the pick index until then (migration 0005).
    Column("wake_at", Timestamp),
    # Set by the reconciler while no live worker serves the lane's route: the lane
    # stays out of its priority's virtual time (migration 0013, lanes_sql._virtual_time).
    Column("unserved", Integer, nullable=False, server_default="0"),
    UniqueConstraint("queue", "route_key", "priority", "tenant", name="uq_lanes_key"),
    # A lane's flow (migration 0012): a tenant's lanes of one queue and priority share
    # one pass (lanes_sql.FLOW_CLAIMED); also every lookup of a tenant's lanes.
    Index("ix_lanes_flow", "tenant", "queue", "priority"),
    Index(
        "ix_lanes_pick",
        "queue", "priority", "pass", "lane_id",
        postgresql_where=text("queued_count > 0 AND tenant_at_limit = 0 AND wake_at IS NULL"),
        sqlite_where=text("queued_count > 0 AND tenant_at_limit = 0 AND wake_at IS NULL"),
    ),
    # PostgreSQL's page of lanes walks each served route on its own (claim_sql.PICK_LANES):
    # lanes of routes nobody serves are never read.
    Index(
        "ix_lanes_route_pick",
        "queue", "route_key", "priority", "pass", "lane_id",
        postgresql_where=text("queued_count > 0 AND tenant_at_limit = 0 AND wake_at IS NULL"),
        sqlite_where=text("queued_count > 0 AND tenant_at_limit = 0 AND wake_at IS NULL"),
    ),
    Index(
        "ix_lanes_wake",
        "wake_at",
        postgresql_where=text("wake_at IS NOT NULL"),
        sqlite_where=text("wake_at IS NOT NULL"),
    ),
)

# A lane asleep because every visible run of it is blocked by a full scope (its
# repository, user or risk class at its limit): one row per blocking scope. The
# release that gives that scope room wakes the lane (migration 0008).
lane_blocks = Table(
    "lane_blocks",
    metadata,
    Column("scope", String(400), primary_key=True),  # as limit_counters.scope
    Column("lane_id", Integer, primary_key=True),
)

# One row per concurrency scope that has a limit (``global``, ``tenant:T``,
# ``repo:R``, ``user:U``, ``risk:K``, ``queue:Q``). A claim takes a slot with a
# guarded increment (``active < max_active``), so limits hold with any number of
# claimers; the attempt's end gives it back.
limit_counters = Table(
    "limit_counters",
    metadata,
    Column("scope", String(400), primary_key=True),
    Column("active", Integer, nullable=False, server_default="0"),
    Column("max_active", Integer, nullable=False),
    Index(
        "ix_limit_counters_full",
        "scope",
        postgresql_where=text("active >= max_active"),
        sqlite_where=text("active >= max_active"),
    ),
)

# Every distinct set of required capabilities seen, so a worker can work out which
# lanes it may serve without scanning runs.
routes = Table(
    "routes",
    metadata,
    Column("route_key", Text, primary_key=True),
    Column("created_at", Timestamp, nullable=False),
)

# The scheduling policy, one row per distinct version (by digest).
# Added by 0026: a model provider paused by its rate limit (PROVIDER_RATE_LIMIT with a
# retry-after) until ``paused_until``; one row per provider, whatever its runs. Claims
# skip the provider's runs meanwhile, for every tenant (claim_sql.with_provider_pauses).
provider_pauses = Table(
    "provider_pauses",
    metadata,
    Column("provider", String(128), primary_key=True),
    Column("paused_until", Float, nullable=False),
    Column("run_id", String(36)),  # the run whose attempt was answered 429
    Column("updated_at", Float, nullable=False),
    # Its tokens per minute (the policy's tokens_per_minute): the tokens its runs
    # reported in the clock minute that began at window_start.
    Column("window_start", Float),
    Column("window_tokens", BigInteger, nullable=False, server_default="0"),
)

policy_versions = Table(
    "policy_versions",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("digest", String(64), nullable=False),  # a document may come back (0009)
    Column("document", JSON, nullable=False),
    Column("source", Text, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    # When a scheduler pass had admitted every queued run again under this version
    # (migration 0010): a scheduler's first pass then skips the backlog.
    Column("backlog_admitted_at", Timestamp),
)

# Model spend per tenant per UTC day, for the daily budget.
tenant_spend = Table(
    "tenant_spend",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("day", String(10), primary_key=True),  # YYYY-MM-DD, UTC
    Column("usd", Float, nullable=False, server_default="0"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("run_id", ID, primary_key=True),  # runs.run_id; no foreign key: see above
    Column("attempt_no", Integer, primary_key=True),
    Column("fencing_token", BigInteger, nullable=False),
    Column("worker_id", String(255), nullable=False),
    Column("status", String(32), nullable=False),  # RUNNING, SUCCEEDED, FAILED, CANCELLED
    Column("reason_code", String(64)),
    Column("message", Text),
    Column("retry_after_seconds", Float),
    Column("lease_status", String(16), nullable=False),  # ACTIVE, RELEASED, EXPIRED, REVOKED
    Column("lease_expires_at", Timestamp, nullable=False),
    Column("lease_ended_at", Timestamp),
    Column("heartbeat_at", Timestamp, nullable=False),
    Column("started_at", Timestamp, nullable=False),
    Column("ended_at", Timestamp),
    Column("cost_usd", Float, nullable=False, server_default="0"),
    Column("input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("estimated_cost_usd", Float),
    # Concurrency scopes this attempt holds a slot in, given back when it ends (0004).
    Column("limit_scopes", JSON),
    # Cost reported after the attempt's lease was lost (0017): spent all the same, and
    # counted in its tenant's day, not in the run's cost_usd (Store.report_late_cost).
    Column("late_cost_usd", Float, nullable=False, server_default="0"),
    # Added by 0025: when this attempt's cost crossed its run's limit; NULL: never.
    Column("cost_exceeded_at", Timestamp),
    # Added by 0028 (leaner rows per run): the attempt is the record of its claim
    # (QUEUED -> CLAIMED, at started_at, by worker_id) and of the hop that ended it
    # (end_from_status -> end_to_status at ended_at, by end_actor or else worker_id):
    # neither writes an event (store/history.py). Each has its place in the event
    # stream: the writer's transaction id (PostgreSQL; 0 on SQLite) and a position
    # taken from run_events' ids. NULL on attempts older than 0028 (their events say).
    Column("claim_tx", BigInteger),
    Column("claim_seq", BigInteger),
    Column("end_tx", BigInteger),
    Column("end_seq", BigInteger),
    Column("end_from_status", String(32)),
    Column("end_to_status", String(32)),
    Column("end_actor", String(255)),
    Column("end_reason_code", String(64)),
    Column("end_message", Text),
    UniqueConstraint("run_id", "fencing_token", name="uq_attempts_run_fencing_token"),
    # Invariant 2: at most one ACTIVE lease per run, enforced by the database.
    Index(
        "uq_attempts_one_active_lease",
        "run_id",
        unique=True,
        postgresql_where=text("lease_status = 'ACTIVE'"),
        sqlite_where=text("lease_status = 'ACTIVE'"),
    ),
    # No index on the worker (migration 0015 dropped ix_attempts_active_lease_worker)
    # nor on the expiry (0027 dropped ix_attempts_active_lease_expiry): a heartbeat
    # names its runs and finds their ACTIVE leases by the one above, and changes no
    # indexed column, so on PostgreSQL a beat can be a HOT update (no index entry). The
    # reaper reads the active leases by the one above too, and sorts them.
    # The event stream's claims and ends (0028, store/events.py), and the latest failed
    # ends (`runlane top`). A heartbeat changes none of their columns: still HOT.
    Index("ix_attempts_claim_feed", "claim_tx", "claim_seq",
          postgresql_where=text("claim_seq IS NOT NULL"),
          sqlite_where=text("claim_seq IS NOT NULL")),
    Index("ix_attempts_end_feed", "end_tx", "end_seq",
          postgresql_where=text("end_seq IS NOT NULL"),
          sqlite_where=text("end_seq IS NOT NULL")),
    Index("ix_attempts_failed_ends", "ended_at", "end_seq",
          postgresql_where=text(FAILED_ENDS_WHERE), sqlite_where=text(FAILED_ENDS_WHERE)),
)

# The transitions no other row records (0028): admission decisions, a creation other
# than QUEUED, stage hops, cancels, requeues, repairs, notes. On SQLite the ids are
# AUTOINCREMENT: claims, ends and creations take their positions from the same count
# (sqlite_sequence, store/history.py), so no id is ever taken twice.
run_events = Table(
    "run_events",
    metadata,
    Column("event_id", EventId, primary_key=True, autoincrement=True),
    Column("run_id", ID, nullable=False),  # runs.run_id; no foreign key: see above
    Column("attempt_no", Integer),
    Column("at", Timestamp, nullable=False),
    Column("actor", String(255), nullable=False),
    Column("from_status", String(32)),
    Column("to_status", String(32), nullable=False),
    Column("reason_code", String(64)),
    Column("fencing_token", BigInteger),
    Column("message", Text),
    # Added by 0021 (the HTTP API's event stream): on PostgreSQL the top-level
    # transaction id of the writer (a trigger sets it; 0 for rows older than 0021), so
    # that a reader delivers events in (tx_id, event_id) order and only from
    # transactions older than every one still running: an event id taken by a
    # transaction that commits later is neither skipped nor delivered twice
    # (store/events.py). SQLite writes one transaction at a time: 0, event_id order.
    Column("tx_id", BigInteger, nullable=False, server_default="0"),
    Index("ix_run_events_run", "run_id", "event_id"),
    Index("ix_run_events_tx", "tx_id", "event_id"),
    # Claims and failures, newest first (migration 0023): `runlane top`'s claim rate and
    # latest failures (store/activity_sql.py). Only claim events, and only the events
    # that moved a run to a failure status, have an entry; events are never updated.
    Index("ix_run_events_claims", "at",
          postgresql_where=text(CLAIM_EVENTS_WHERE), sqlite_where=text(CLAIM_EVENTS_WHERE)),
    Index("ix_run_events_failures", "at", "event_id",
          postgresql_where=text(FAILURE_EVENTS_WHERE),
          sqlite_where=text(FAILURE_EVENTS_WHERE)),
    sqlite_autoincrement=True,
)

# The side-effect ledger (invariant 8): one row per external effect of a run, keyed
# by the effect's deterministic identity. INTENT is written, with the fencing token,
# before the external call; DONE with its result after. A retried finalizer finds
# the row (or the effect's marker outside) and never acts twice.
side_effects = Table(
    "side_effects",
    metadata,
    Column("run_id", ID, ForeignKey("runs.run_id"), primary_key=True),
    Column("effect_key", String(255), primary_key=True),
    Column("status", String(16), nullable=False),  # INTENT, DONE
    Column("attempt_no", Integer, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("result", JSON),
    Column("created_at", Timestamp, nullable=False),
    Column("completed_at", Timestamp),
)

workers = Table(
    "workers",
    metadata,
    Column("worker_id", String(255), primary_key=True),
    Column("version", String(64), nullable=False),
    Column("queues", JSON, nullable=False),
    Column("capabilities", JSON, nullable=False),
    Column("status", String(16), nullable=False),  # STARTING, READY, DRAINING, STOPPED, DEAD
    Column("started_at", Timestamp, nullable=False),
    Column("heartbeat_at", Timestamp, nullable=False),
    # Set by `runlane workers drain` (0020): the worker drains at its next heartbeat.
    Column("drain_requested_at", Timestamp),
)


# API tokens (0019): a tenant's (or, tenant NULL, an admin's) bearer token. Only the
# SHA-256 of the secret is kept (domain/tokens.py); the id is the secret's own prefix,
# so a request finds its row by the primary key.
api_tokens = Table(
    "api_tokens",
    metadata,
    Column("token_id", String(32), primary_key=True),
    Column("tenant", String(128)),  # NULL: every tenant (role admin)
    Column("role", String(16), nullable=False),  # read, submit, approve, admin
    Column("name", String(255)),
    Column("secret_sha256", String(64), nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("expires_at", Timestamp),
    Column("revoked_at", Timestamp),
    Column("last_used_at", Timestamp),
)


# --- campaigns (migration 0024, docs/campaigns.md) -------------------------------------
# A campaign's targets get their tasks only when the rollout dispatches them (the
# scheduler pass, store/campaigns.py): an undispatched target has no run, so nothing of
# an unreleased batch can be claimed, and the queue holds at most the campaign's
# ``max_active`` runs of it.
campaigns = Table(
    "campaigns",
    metadata,
    Column("campaign_id", ID, primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("name", String(128), nullable=False),
    Column("owner", String(255)),
    Column("status", String(16), nullable=False),  # domain.campaigns.CampaignStatus
    Column("digest", String(64), nullable=False),  # of the file as validated
    Column("document", JSON, nullable=False),  # the campaign without its targets
    Column("batches", JSON, nullable=False),  # the size of each batch
    # The newest batch released (0: the canary, released at creation); a release is a
    # compare-and-set on it, so two schedulers never release one batch twice.
    Column("released_batch", Integer, nullable=False, server_default="0"),
    Column("released_at", JSON, nullable=False),  # when each batch was released
    Column("active", Integer, nullable=False, server_default="0"),  # dispatched, not ended
    Column("finishes", Integer, nullable=False, server_default="0"),  # counted finishes
    # The stop rule's window: one character per counted finish, newest first, "1" a
    # failure, at most the rule's ``window`` long. Kept in the campaign's row, so a run's
    # end updates it with the row's newest version under its lock (one statement on
    # PostgreSQL, store/campaigns_sql.py TARGET_END_PG); a retry-failed empties it.
    Column("recent", Text, nullable=False, server_default=text("''")),
    Column("stop_window", Integer, nullable=False),  # the stop rule's window (its N)
    Column("stop_reason", Text),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Column("ended_at", Timestamp),
    UniqueConstraint("tenant", "name", name="uq_campaigns_tenant_name"),
)

campaign_targets = Table(
    "campaign_targets",
    metadata,
    Column("campaign_id", ID, primary_key=True),
    Column("position", Integer, primary_key=True),  # in the file
    Column("target_key", String(32), nullable=False),
    Column("repo", Text, nullable=False),
    Column("vars", JSON, nullable=False),
    Column("owner", String(255)),
    Column("batch", Integer, nullable=False),
    Column("state", String(16), nullable=False),  # domain.campaigns.TargetState
    Column("generation", Integer, nullable=False, server_default="0"),  # retry-failed
    Column("task_id", ID),
    Column("run_id", ID),
    Column("dispatched_at", Timestamp),
    Column("ended_at", Timestamp),
    Column("run_status", String(32)),
    Column("reason_code", String(64)),
    Column("outcome", String(64)),
    UniqueConstraint("campaign_id", "target_key", name="uq_campaign_targets_key"),
    # The dispatch's pick: a campaign's pending targets of released batches, in order.
    Index("ix_campaign_targets_state", "campaign_id", "state", "batch", "position"),
    # A run's end finds its target (campaigns_sql.TARGET_END_PG, lease_sql._SET_RETURNING).
    Index("ix_campaign_targets_run", "run_id",
          postgresql_where=text("run_id IS NOT NULL"), sqlite_where=text("run_id IS NOT NULL")),
)

# Every counted finish of a campaign's runs, numbered: the stop rule's window is the
# newest ``window`` of them; the report's failure rate per batch.
campaign_outcomes = Table(
    "campaign_outcomes",
    metadata,
    Column("campaign_id", ID, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("position", Integer, nullable=False),
    Column("run_id", ID, nullable=False),
    Column("batch", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("reason_code", String(64)),
    Column("at", Timestamp, nullable=False),
)

# The notification outbox: written in the transaction that records what it tells (a
# run's end, the campaign's stop, pause or completion), sent after by the scheduler
# pass, each with its id (the receiver dedupes on it), retried with backoff.
campaign_notifications = Table(
    "campaign_notifications",
    metadata,
    Column("notification_id", ID, primary_key=True),
    Column("campaign_id", ID, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("recipient", String(255)),
    Column("payload", JSON, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("next_at", Timestamp, nullable=False),
    Column("delivered_at", Timestamp),
    Column("last_error", Text),
    Index("ix_campaign_notifications_due", "next_at",
          postgresql_where=text("delivered_at IS NULL"),
          sqlite_where=text("delivered_at IS NULL")),
)

# Approval decisions (0025): one row per run held by an approval gate, written when a
# person approves or rejects it or its gate's timeout passes (decision APPROVED,
# REJECTED or EXPIRED); the primary key makes a second decision of the same run a
# no-op. Deleted with the run by retention.
run_approvals = Table(
    "run_approvals",
    metadata,
    Column("run_id", ID, primary_key=True),  # runs.run_id; no foreign key, as runs'
    Column("tenant", String(128), nullable=False),
    Column("decision", String(16), nullable=False),
    Column("actor", String(255), nullable=False),
    Column("note", Text),
    Column("policy_version", Integer, nullable=False),  # the version in force then
    Column("decided_at", Timestamp, nullable=False),
)
