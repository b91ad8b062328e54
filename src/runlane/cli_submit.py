"""``runlane submit``: one task from flags (the prompt from a file or stdin too) or a
batch of JSON Lines (a file or stdin). What can never succeed is refused here, before
anything is written: a repository no code host serves, a local path that does not
exist. A run the policy denies exits 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from runlane.cli_common import _lane, json_flag, out
from runlane.cli_output import print_json
from runlane.domain.routing import parse_requirements, requirements_to_mapping
from runlane.domain.tasks import TaskInvalid
from runlane.errors import RunlaneError

DENIED = "POLICY_DENIED"


class SubmitDenied(RunlaneError):
    """The policy denied the run (it is recorded, POLICY_DENIED): exit 1."""


@click.command()
@click.option("--tenant", help="Who the run is for.")
@click.option("--repo", help="Repository: a local path, a file:// URL or a GitHub "
              "repository (https://github.com/OWNER/NAME or OWNER/NAME).")
@click.option("--prompt", help="What the agent should do.")
@click.option("--prompt-file", "prompt_file", type=click.Path(allow_dash=True, path_type=Path),
              help="Read the prompt from this file (UTF-8), or from stdin with -: for "
              "prompts too long for a command line.")
@click.option("--queue", help="Queue of the run (default: the policy's, else 'default').")
@click.option("--priority", help="Integer (lower first) or critical|high|normal|low|batch.")
@click.option("--idempotency-key",
              help="Per tenant: the same key and request again returns the same task and "
              "run; the same key with another request is refused (a conflict).")
@click.option("--max-attempts",
              help="Attempts of this run, 1-100 (default: the policy's, else the setting "
              "MAX_ATTEMPTS).")
@click.option("--require", "requires", multiple=True,
              help="Required worker capability: KEY=VALUE, KEY=A,B (set), KEY=N (at least), "
              "KEY>=VERSION (repeatable).")
@click.option("--depends-on", "depends_on", multiple=True,
              help="Task that must succeed before this one runs (repeatable).")
@click.option("--parent", "parent_task_id", help="Task this one follows up on.")
@click.option("--user", help="Who asked (for per-user limits).")
@click.option("--estimated-cost", "estimated_cost_usd", help="Expected model cost in USD.")
@click.option("--provider", help="Model provider the agent uses (for the policy's provider "
              "limits; default: the queue's provider in the policy).")
@click.option("--context", type=click.Path(path_type=Path),
              help="JSON object of optional context sections (summary, history, comments, "
              "diff, ci_failures).")
@click.option("--batch", type=click.Path(allow_dash=True, path_type=Path),
              help="JSON Lines file (- for stdin), one task per line with the flags' names "
              "as fields; all or nothing.")
@click.option("--no-repo-check", is_flag=True,
              help="Do not refuse a repository this machine's code hosts cannot serve (it "
              "is served where the workers run, not here).")
@json_flag
def submit(tenant: str | None, repo: str | None, prompt: str | None,
           prompt_file: Path | None, queue: str | None, priority: str | None,
           idempotency_key: str | None, max_attempts: str | None, requires: tuple[str, ...],
           depends_on: tuple[str, ...], parent_task_id: str | None, user: str | None,
           estimated_cost_usd: str | None, provider: str | None, context: Path | None,
           batch: Path | None,
           no_repo_check: bool, as_json: bool) -> None:
    """Submit a task (or a batch); the same tenant and idempotency key returns the same run.

    Each run is admitted under the policy in force: it is queued, deferred
    (WAITING_CAPACITY, with a reason code) or denied (POLICY_DENIED: exit 1)."""
    if batch is not None:
        if any(v is not None for v in (tenant, repo, prompt, prompt_file, queue, priority,
                                       idempotency_key, max_attempts, context,
                                       parent_task_id, user, estimated_cost_usd,
                                       provider)) \
                or requires or depends_on:
            raise TaskInvalid("--batch", "cannot be combined with per-task flags")
        rows = _read_jsonl(batch)
        if not no_repo_check:
            for number, row in enumerate(rows, start=1):
                if isinstance(row, dict) and isinstance(row.get("repo"), str):
                    _check_repo(row["repo"], f"line {number}: repo")
        with _lane() as lane:
            results = lane.submit_batch(rows)
        denied = [s for s in results if s.status == DENIED]
        if as_json:
            print_json([_submission(s) for s in results])
        else:
            created = sum(1 for s in results if s.created and s.status != DENIED)
            present = sum(1 for s in results if not s.created)
            out.print(f"{len(results)} task(s): {created} created, {present} already present,"
                      f" {len(denied)} denied", highlight=False)
            for s in denied:
                out.print(f"denied: run {s.run_id} ({s.reason_code})", soft_wrap=True,
                          highlight=False)
        if denied:
            raise SubmitDenied(f"denied: {len(denied)} of {len(results)} run(s) "
                               f"({', '.join(sorted({str(s.reason_code) for s in denied}))})")
        return
    if prompt is not None and prompt_file is not None:
        raise TaskInvalid("--prompt-file", "give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        prompt = _read_text(prompt_file, "--prompt-file")
    raw: dict[str, Any] = {"tenant": tenant, "repo": repo, "prompt": prompt, "queue": queue,
                           "priority": priority, "idempotency_key": idempotency_key,
                           "max_attempts": max_attempts, "parent_task_id": parent_task_id,
                           "user": user, "estimated_cost_usd": estimated_cost_usd,
                           "provider": provider}
    if requires:
        try:
            raw["requires"] = requirements_to_mapping(parse_requirements(list(requires)))
        except ValueError as exc:
            raise TaskInvalid("--require", str(exc)) from None
    if depends_on:
        raw["depends_on"] = list(depends_on)
    if context is not None:
        raw["context"] = _read_json(context, "--context")
    missing = [f"--{k}" for k in ("tenant", "repo", "prompt") if raw[k] is None]
    if missing:
        raise TaskInvalid(missing[0], "is required (or use --batch FILE)")
    if not no_repo_check:
        _check_repo(str(repo), "--repo")
    with _lane() as lane:
        result = lane.submit(**{k: v for k, v in raw.items() if v is not None})
    if as_json:
        print_json(_submission(result))
    else:
        verb = ("denied" if result.status == DENIED else
                "submitted" if result.created else "already submitted")
        why = f": {result.reason_code}" if result.reason_code else ""
        # One line each, whatever the terminal's width: ids are copied from here.
        out.print(f"{verb}: run {result.run_id} ({result.status}{why})", soft_wrap=True,
                  highlight=False)
        out.print(f"task {result.task_id}", soft_wrap=True, highlight=False)
    if result.status == DENIED:
        raise SubmitDenied(f"denied: {result.reason_code} (run {result.run_id} is "
                           "POLICY_DENIED; `runlane runs show` says why)")


def _check_repo(repo: str, flag: str) -> None:
    from runlane.codehost.factory import repository_problem

    problem = repository_problem(repo)
    if problem is not None:
        raise TaskInvalid(flag, problem)


def _submission(s: Any) -> dict[str, Any]:
    return {"task_id": s.task_id, "run_id": s.run_id, "status": s.status, "created": s.created,
            "reason_code": s.reason_code, "truncated_sections": list(s.truncated_sections),
            "payload_bytes": s.payload_bytes}


def _read_text(path: Path, flag: str) -> str:
    """A file's text, or stdin's for ``-``."""
    try:
        if str(path) == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TaskInvalid(flag, f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise TaskInvalid(flag, f"cannot read {path}: {exc.strerror}") from None


def _read_json(path: Path, flag: str) -> Any:
    text = _read_text(path, flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskInvalid(flag, f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None


def _read_jsonl(path: Path) -> list[Any]:
    lines = _read_text(path, "--batch").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TaskInvalid(f"line {number}", f"is not JSON: {exc.msg}") from None
    if not rows:
        raise TaskInvalid("--batch", f"{'stdin' if str(path) == '-' else path} holds no tasks")
    return rows
