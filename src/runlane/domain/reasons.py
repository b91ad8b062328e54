"""Reason codes: why an attempt or a run ended the way it did.

Retry decisions are made from these codes, never from log text.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    WORKER_LOST = "WORKER_LOST"
    SANDBOX_START_TIMEOUT = "SANDBOX_START_TIMEOUT"
    PROVIDER_RATE_LIMIT = "PROVIDER_RATE_LIMIT"
    GIT_CLONE_FAILED_TRANSIENT = "GIT_CLONE_FAILED_TRANSIENT"
    POLICY_DENIED = "POLICY_DENIED"
    TASK_CONTRACT_INVALID = "TASK_CONTRACT_INVALID"
    VERIFIER_FAILED = "VERIFIER_FAILED"
    JUDGE_REJECTED = "JUDGE_REJECTED"
    CANCELLED_BY_USER = "CANCELLED_BY_USER"
    AGENT_FAILED = "AGENT_FAILED"
    TIMEOUT = "TIMEOUT"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    LEASE_LOST = "LEASE_LOST"
    # A push or a code-host call failed in a way a retry may fix (network, 5xx, 429).
    CODE_HOST_FAILED_TRANSIENT = "CODE_HOST_FAILED_TRANSIENT"
    # The worker itself failed (a bug, not the agent): not retried blindly.
    WORKER_ERROR = "WORKER_ERROR"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    # Budgets of a run (seed 000 §15): recorded when a retryable failure is not retried.
    RETRY_BUDGET_EXHAUSTED = "RETRY_BUDGET_EXHAUSTED"
    # Lease given back on purpose (drain past its grace period).
    LEASE_RELEASED = "LEASE_RELEASED"
    # A release past the run's cap of uncharged ones (MAX_UNCHARGED_RELEASES): charged
    # against its attempts, retried with backoff while attempts remain.
    LEASE_RELEASED_OVER_CAP = "LEASE_RELEASED_OVER_CAP"
    # Reconciler repairs (seed 000 §25), each recorded with its own code.
    RECONCILED_ADMITTED_NOT_QUEUED = "RECONCILED_ADMITTED_NOT_QUEUED"
    RECONCILED_TERMINAL_LEASE = "RECONCILED_TERMINAL_LEASE"
    RECONCILED_WAITING_LEASE = "RECONCILED_WAITING_LEASE"
    RECONCILED_ACTIVE_WITHOUT_LEASE = "RECONCILED_ACTIVE_WITHOUT_LEASE"
    RECONCILED_CANCELLED_TASK = "RECONCILED_CANCELLED_TASK"
    WORKER_HEARTBEAT_STALE = "WORKER_HEARTBEAT_STALE"
    # Admission and routing (seed 000 §16-§17, §26, §30): see docs/policy.md.
    REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT = "REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT"
    TENANT_NOT_ALLOWED = "TENANT_NOT_ALLOWED"
    RISK_CLASS_NOT_ALLOWED = "RISK_CLASS_NOT_ALLOWED"
    TENANT_DAILY_MODEL_BUDGET_EXCEEDED = "TENANT_DAILY_MODEL_BUDGET_EXCEEDED"
    TENANT_QUEUE_FULL = "TENANT_QUEUE_FULL"
    POLICY_RULE_DENIED = "POLICY_RULE_DENIED"
    POLICY_RULE_DEFERRED = "POLICY_RULE_DEFERRED"
    DEPENDENCY_FAILED = "DEPENDENCY_FAILED"
    # Approval gates (docs/policy.md): why a run waits, and why it ended without one.
    APPROVAL_REQUIRED = "APPROVAL_REQUIRED"
    APPROVAL_REJECTED = "APPROVAL_REJECTED"
    APPROVAL_EXPIRED = "APPROVAL_EXPIRED"
    UNROUTABLE = "UNROUTABLE"
    # Pull-request evidence (docs/reliability.md): a finalize-only attempt found neither
    # the run's pushed branch nor its pull request, so there is nothing to record.
    NOTHING_TO_FINALIZE = "NOTHING_TO_FINALIZE"
    # A note on a run (an event that changes no status): a commit on the run's branch
    # that was neither this attempt's nor the one its ledger recorded (a push that
    # outlived its lease) was replaced, never adopted.
    STALE_PUSH_REPLACED = "STALE_PUSH_REPLACED"
    # A note on a run: a push or a pull request was made by an attempt whose lease was
    # lost meanwhile (a paused worker finishing a call it began), recorded late in the
    # ledger; a run that already ended without success is due a withdrawal again.
    LATE_EFFECT_RECORDED = "LATE_EFFECT_RECORDED"
    # Campaigns (docs/campaigns.md): a run cancelled because its campaign stopped (its
    # stop rule fired, or a user stopped it); a run held while its campaign is paused.
    CAMPAIGN_STOPPED = "CAMPAIGN_STOPPED"
    CAMPAIGN_PAUSED = "CAMPAIGN_PAUSED"


DEFAULT_RETRYABLE: frozenset[Reason] = frozenset(
    {
        Reason.WORKER_LOST,
        Reason.SANDBOX_START_TIMEOUT,
        Reason.PROVIDER_RATE_LIMIT,
        Reason.GIT_CLONE_FAILED_TRANSIENT,
        Reason.TIMEOUT,
        Reason.LEASE_RELEASED,
        Reason.CODE_HOST_FAILED_TRANSIENT,
        Reason.LEASE_RELEASED_OVER_CAP,
    }
)


# Codes only runlane itself may record. An agent that reports one of these (a fail
# control line, AgentFailed) is treated as AGENT_FAILED: an agent must not be able to
# claim it was drained (uncharged, instant retry) or that a user cancelled it.
WORKER_ONLY: frozenset[Reason] = frozenset(
    {
        Reason.LEASE_RELEASED,
        Reason.LEASE_RELEASED_OVER_CAP,
        Reason.LEASE_LOST,
        Reason.WORKER_LOST,
        Reason.WORKER_ERROR,
        Reason.CANCELLED_BY_USER,
        Reason.RETRY_BUDGET_EXHAUSTED,
        Reason.RECONCILED_ADMITTED_NOT_QUEUED,
        Reason.RECONCILED_TERMINAL_LEASE,
        Reason.RECONCILED_WAITING_LEASE,
        Reason.RECONCILED_ACTIVE_WITHOUT_LEASE,
        Reason.RECONCILED_CANCELLED_TASK,
        Reason.WORKER_HEARTBEAT_STALE,
        Reason.NOTHING_TO_FINALIZE,
        Reason.STALE_PUSH_REPLACED,
        Reason.LATE_EFFECT_RECORDED,
        Reason.CAMPAIGN_STOPPED,
        Reason.CAMPAIGN_PAUSED,
        Reason.APPROVAL_REQUIRED,
        Reason.APPROVAL_REJECTED,
        Reason.APPROVAL_EXPIRED,
    }
)
