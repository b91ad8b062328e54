"""The facade's campaigns (``Runlane`` inherits it): create from a file or text, list,
show (progress by state and by batch, failure rate, failed runs with reasons, pull
requests), the summary report (JSON or Markdown), pause, resume, stop, retry-failed.
The CLI (cli_campaigns.py) and the HTTP API (http/routes/campaigns.py) call these.

Who may do what: a tenant's principal sees and changes its own tenant's campaigns only
(another tenant's is answered as one that does not exist); a ``read`` principal never
changes one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runlane.api_common import _on_the_database
from runlane.domain.access import OPERATOR, Principal
from runlane.domain.campaigns import Campaign, load_campaign, parse_campaign
from runlane.errors import Forbidden, NotFound
from runlane.store.campaigns import CampaignConfig, _json

if TYPE_CHECKING:
    from runlane.settings import Settings
    from runlane.store.store import Store

STATES = ("PENDING", "ACTIVE", "SUCCEEDED", "FAILED", "CANCELLED")


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(float(epoch), UTC).isoformat()


def _may_change(principal: Principal, tenant: str, what: str) -> None:
    if not principal.can_submit:
        raise Forbidden(f"a {principal.role.value} token may not {what}")
    if principal.tenant is not None and principal.tenant != tenant:
        raise Forbidden(f"this token is tenant {principal.tenant!r}'s: it may not "
                        f"{what} for tenant {tenant!r}")


def _brief(row: Any) -> dict[str, Any]:
    batches = _json(row.batches)
    return {"campaign_id": row.campaign_id, "name": row.name, "tenant": row.tenant,
            "owner": row.owner, "status": row.status, "targets": sum(batches),
            "batches": len(batches), "released_batch": int(row.released_batch),
            "active": int(row.active), "stop_reason": row.stop_reason,
            "created_at": _iso(row.created_at), "ended_at": _iso(row.ended_at)}


class CampaignsMixin:
    """Campaigns of the facade (``runlane.api.Runlane``)."""

    if TYPE_CHECKING:
        store: Store
        settings: Settings

    # --- create ----------------------------------------------------------------------

    @_on_the_database
    def create_campaign(self, *, path: str | Path | None = None, text: str | None = None,
                        source: str = "<api>", principal: Principal = OPERATOR
                        ) -> dict[str, Any]:
        """A campaign from a file (``path``, its ``targets_file`` read beside it) or its
        TOML ``text`` (targets inline: a request never names a file of the server). The
        same campaign again returns the first (``created`` false); another one under a
        taken name is a Conflict."""
        if not principal.can_submit:
            raise Forbidden(f"a {principal.role.value} token may not create a campaign")
        campaign: Campaign = load_campaign(path) if path is not None else parse_campaign(
            text or "", source, None)
        _may_change(principal, campaign.tenant, "create a campaign")
        created = self.store.create_campaign(campaign)
        row = self.store.find_campaign(campaign.name, campaign.tenant)
        return {**_brief(row), "created": created.created,
                "batch_sizes": campaign.batches()}

    # --- read ------------------------------------------------------------------------

    def _campaign_row(self, name: str, principal: Principal, tenant: str | None) -> Any:
        if not isinstance(name, str) or not name:
            raise NotFound(f"no campaign {name!r}")
        if principal.tenant is not None:
            if tenant is not None and tenant != principal.tenant:
                raise NotFound(f"no campaign {name!r}")
            tenant = principal.tenant
        return self.store.find_campaign(name, tenant)

    @_on_the_database
    def campaigns(self, *, principal: Principal = OPERATOR) -> list[dict[str, Any]]:
        return [_brief(r) for r in self.store.list_campaigns(principal.tenant)]

    @_on_the_database
    def campaign(self, name: str, *, tenant: str | None = None,
                 principal: Principal = OPERATOR) -> dict[str, Any]:
        """The campaign's progress and summary: by state, by batch, the stop rule's
        window, failures by reason with their runs, pull requests, cost, durations."""
        row = self._campaign_row(name, principal, tenant)
        return _summary(self.store.campaign_summary(row.campaign_id))

    @_on_the_database
    def campaign_report(self, name: str, *, tenant: str | None = None,
                        principal: Principal = OPERATOR) -> str:
        """The summary as Markdown."""
        row = self._campaign_row(name, principal, tenant)
        return markdown_report(_summary(self.store.campaign_summary(row.campaign_id)))

    # --- operator moves --------------------------------------------------------------

    def _move(self, name: str, tenant: str | None, principal: Principal, what: str,
              move: Any) -> dict[str, Any]:
        if not principal.can_submit:  # before the lookup: a read token learns nothing
            raise Forbidden(f"a {principal.role.value} token may not {what} a campaign")
        row = self._campaign_row(name, principal, tenant)
        _may_change(principal, row.tenant, f"{what} a campaign")
        changed = move(row.campaign_id)
        after = self.store.find_campaign(row.name, row.tenant)
        return {**_brief(after), "changed": changed}

    @_on_the_database
    def pause_campaign(self, name: str, *, tenant: str | None = None,
                       principal: Principal = OPERATOR) -> dict[str, Any]:
        return self._move(name, tenant, principal, "pause", self.store.pause_campaign)

    @_on_the_database
    def resume_campaign(self, name: str, *, tenant: str | None = None,
                        principal: Principal = OPERATOR) -> dict[str, Any]:
        return self._move(name, tenant, principal, "resume", self.store.resume_campaign)

    @_on_the_database
    def stop_campaign(self, name: str, *, tenant: str | None = None,
                      cancel_running: bool = False,
                      principal: Principal = OPERATOR) -> dict[str, Any]:
        """Stop: no more dispatch, waiting runs cancelled (CAMPAIGN_STOPPED); running
        runs finish unless ``cancel_running`` (or the file's ``stop.cancel_running``):
        then they are cancelled too, each as `runlane cancel` would."""
        out = self._move(name, tenant, principal, "stop", self.store.stop_campaign)
        found = self.store.find_campaign(out["name"], out["tenant"])
        if cancel_running or self.store._campaign_config(found).stop.cancel_running:
            out["cancelled_running"] = self.store.cancel_campaign_running(
                found.campaign_id, actor=f"token:{principal.token_id}" if principal.token_id
                else "user")
        else:
            out["cancelled_running"] = 0
        return out

    @_on_the_database
    def retry_failed_campaign(self, name: str, *, tenant: str | None = None,
                              principal: Principal = OPERATOR) -> dict[str, Any]:
        out = self._move(name, tenant, principal, "retry", self.store.retry_failed_campaign)
        out["retried"] = out.pop("changed")
        return out


def _summary(found: dict[str, Any]) -> dict[str, Any]:
    row = found["row"]
    cfg: CampaignConfig = found["config"]
    batches = _json(row.batches)
    released_at = _json(row.released_at)
    by_state = dict.fromkeys(STATES, 0)
    by_batch: list[dict[str, Any]] = [
        {"batch": i, "size": size, "released_at": _iso(released_at[i])
         if i < len(released_at) else None, **dict.fromkeys(STATES, 0)}
        for i, size in enumerate(batches)]
    for r in found["by_batch"]:
        by_state[r.state] += int(r.n)
        by_batch[int(r.batch)][r.state] += int(r.n)
    for o in found["outcomes"]:
        b = by_batch[int(o.batch)]
        b["finished"] = int(o.finished)
        b["failed_counted"] = int(o.failed or 0)
        b["failure_rate"] = round(int(o.failed or 0) / int(o.finished), 4) if o.finished else None
        b["first_finished_at"], b["last_finished_at"] = _iso(o.first_at), _iso(o.last_at)
    window = found["window"]
    pull_requests, no_changes = [], 0
    for s in found["succeeded"]:
        result = _json(s.result) if s.result is not None else None
        if result:
            pull_requests.append({"repo": s.repo, "run_id": s.run_id,
                                  "url": result.get("url"), "number": result.get("number")})
        elif s.outcome == "no_changes":
            no_changes += 1
    created, ended = float(row.created_at), row.ended_at
    return {
        **_brief(row),
        "prompt": cfg.prompt,
        "rollout": cfg.rollout.model_dump(mode="json"),
        "concurrency": cfg.concurrency.model_dump(mode="json"),
        "stop_rule": cfg.stop.model_dump(mode="json"),
        "by_state": by_state,
        "by_batch": by_batch,
        "not_started": by_state["PENDING"],
        "succeeded_with_pull_request": len(pull_requests),
        "no_changes": no_changes,
        "failed_by_reason": {r.reason_code: int(r.n) for r in found["failures_by_reason"]},
        "cancelled_by_reason": {r.reason_code: int(r.n)
                                for r in found["cancelled_by_reason"]},
        "failure_rate": {"window": len(window), "failed": sum(window),
                         "rate": round(sum(window) / len(window), 4) if window else None},
        "failed_runs": [{"repo": f.repo, "owner": f.owner, "batch": int(f.batch),
                         "run_id": f.run_id, "task_id": f.task_id, "status": f.run_status,
                         "reason_code": f.reason_code, "message": f.message}
                        for f in found["failed"]],
        "pull_requests": pull_requests,
        "cost_usd": round(found["cost_usd"], 6),
        "duration_seconds": None if ended is None else round(float(ended) - created, 3),
        "notifications": {
            "total": len(found["notifications"]),
            "delivered": sum(1 for n in found["notifications"] if n.delivered_at is not None)},
    }


def markdown_report(s: dict[str, Any]) -> str:
    """The summary a campaign's owner reads: what was done, what failed and why."""
    lines = [f"# Campaign {s['name']} ({s['tenant']})", "",
             f"Status: **{s['status']}**" + (f" — {s['stop_reason']}" if s["stop_reason"]
                                             else ""), "",
             "| targets | succeeded with PR | no changes | failed | cancelled | not started |"
             " active |", "| --- | --- | --- | --- | --- | --- | --- |",
             f"| {s['targets']} | {s['succeeded_with_pull_request']} | {s['no_changes']} | "
             f"{s['by_state']['FAILED']} | {s['by_state']['CANCELLED']} | {s['not_started']} | "
             f"{s['by_state']['ACTIVE']} |", "",
             f"Cost: ${s['cost_usd']:.2f}. "
             + (f"Time to finish: {s['duration_seconds']:.0f} s." if s["duration_seconds"]
                is not None else "Not finished."), ""]
    rate = s["failure_rate"]
    if rate["window"]:
        lines += [f"Failure rate over the last {rate['window']} counted runs: "
                  f"{rate['rate']:.0%} (the stop rule: over "
                  f"{s['stop_rule']['failure_rate']:.0%} of {s['stop_rule']['window']}, "
                  f"at least {s['stop_rule']['min_sample']}).", ""]
    lines += ["## Batches", "", "| batch | size | released | succeeded | failed | cancelled |"
              " failure rate |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for b in s["by_batch"]:
        rate_text = "" if b.get("failure_rate") is None else f"{b['failure_rate']:.0%}"
        lines.append(f"| {b['batch']} | {b['size']} | {b['released_at'] or '—'} | "
                     f"{b['SUCCEEDED']} | {b['FAILED']} | {b['CANCELLED']} | {rate_text} |")
    if s["failed_by_reason"]:
        lines += ["", "## Failed, by reason", ""]
        lines += [f"- {reason or '(none)'}: {n}" for reason, n in s["failed_by_reason"].items()]
        lines += ["", "| repository | owner | reason | run |", "| --- | --- | --- | --- |"]
        lines += [f"| {f['repo']} | {f['owner'] or ''} | {f['reason_code'] or ''} | "
                  f"`{f['run_id']}` |" for f in s["failed_runs"]]
    if s["cancelled_by_reason"]:
        lines += ["", "## Cancelled, by reason", ""]
        lines += [f"- {reason or '(none)'}: {n}"
                  for reason, n in s["cancelled_by_reason"].items()]
    if s["pull_requests"]:
        lines += ["", "## Pull requests", ""]
        lines += [f"- {p['repo']}: {p['url'] or '#' + str(p['number'])}"
                  for p in s["pull_requests"]]
    return "\n".join(lines) + "\n"
