"""Traces (issue 24): the submit starts a task's trace, each attempt is a span of it with
a child per stage, the agent's control lines are events, the agent gets TRACEPARENT,
and a retry after a worker's SIGKILL lands in the same trace. Real workers, real git,
real sandboxes, SQLite and PostgreSQL; spans read from the SDK's in-memory exporter, or,
across processes, from a real OTLP/HTTP collector stub (tests/otlp_collector.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text

from runlane.api import Runlane
from runlane.codehost.local_forge import LocalForge
from runlane.domain.retry import RetryPolicy
from runlane.observability import tracing
from runlane.settings import Settings, SettingsInvalid
from runlane.store.store import Store

from .http_support import wait_until
from .otlp_collector import CollectedSpan, Collector
from .support import attempts_of, bare_remote, cli_env, fast_lane, processes_in, run_row

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("runlane.admission", "runlane.clone", "runlane.agent", "runlane.verify",
          "runlane.judge", "runlane.push", "runlane.pull_request")
# Writes its environment where the test reads it, reports a tool call (start and end),
# an iteration and progress, then changes a file.
AGENT = ("env > \"$RUNLANE_ARTIFACTS_DIR/env-$RUNLANE_ATTEMPT.txt\"; "
         "echo '{\"runlane\": \"tool_call\", \"id\": \"call-7\", \"name\": \"edit\"}'; "
         "echo '{\"runlane\": \"tool_call\", \"id\": \"call-7\", \"name\": \"edit\", "
         "\"seconds\": 0.5}'; "
         "echo '{\"runlane\": \"iteration\"}'; "
         "echo '{\"runlane\": \"progress\", \"message\": \"half way\"}'; "
         "echo change > change.txt")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """runlane's spans, kept in memory (runlane's own provider: OpenTelemetry's global
    one is set once per process and would trace every later test)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_provider(provider)
    try:
        yield exporter
    finally:
        tracing.set_provider(None)
        provider.shutdown()


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    return bare_remote(tmp_path)


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    with fast_lane(db_url, tmp_path) as lane:
        yield lane


def run_worker(lane: Runlane, tmp_path: Path, agent: str, **options: Any) -> list[str]:
    worker = lane.worker(agent_command=agent, exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(tmp_path / "forge"), **options)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return worker.outcomes


def agent_env(tmp_path: Path, run_id: str, attempt: int) -> dict[str, str]:
    path = tmp_path / "artifacts" / run_id / str(attempt) / f"env-{attempt}.txt"
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def traceparent_of(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def stored_traceparent(lane: Runlane, task_id: str) -> str | None:
    with lane.store.engine.connect() as conn:
        return conn.execute(text("SELECT traceparent FROM tasks WHERE task_id = :t"),
                            {"t": task_id}).scalar_one()  # type: ignore[no-any-return]


def assert_has(span: ReadableSpan, expected: dict[str, Any]) -> None:
    attributes = dict(span.attributes or {})
    assert {k: attributes.get(k) for k in expected} == expected, attributes


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = defaultdict(list)
    for span in exporter.get_finished_spans():
        named[span.name].append(span)
    return named


def test_an_attempt_and_its_stages_are_spans_of_the_submits_trace(
        lane: Runlane, remote: Path, tmp_path: Path, spans: InMemorySpanExporter) -> None:
    sub = lane.submit("acme", str(remote), "improve the code")
    outcomes = run_worker(lane, tmp_path, AGENT, verify_command="true",
                          judge=lambda task, workspace, result: None)
    assert outcomes == ["pull_request"]
    named = by_name(spans)
    [submit] = named["runlane.submit"]
    [attempt] = named["runlane.attempt"]
    assert submit.parent is None and submit.context is not None
    assert attempt.parent is not None and attempt.context is not None
    trace_id = submit.context.trace_id
    # The chain: submit -> attempt -> every stage (-> each command's sandbox start).
    assert (attempt.parent.trace_id, attempt.parent.span_id) == (trace_id,
                                                                  submit.context.span_id)
    stage = {}
    for name in STAGES:
        [stage[name]] = named[name]
        assert stage[name].parent is not None, name
        assert (stage[name].parent.trace_id, stage[name].parent.span_id) == (
            trace_id, attempt.context.span_id), name
    starts = named["runlane.sandbox_start"]
    assert sorted(s.parent.span_id for s in starts if s.parent) == sorted(
        stage[n].context.span_id for n in ("runlane.agent", "runlane.verify")
        if stage[n].context)
    # The ids of the seed's chain on the attempt's span.
    [row] = attempts_of(lane.store, sub.run_id)
    assert_has(attempt, {
        "runlane.task_id": sub.task_id, "runlane.run_id": sub.run_id,
        "runlane.attempt_id": f"{sub.run_id}/1", "runlane.attempt_no": 1,
        "runlane.lease_id": f"{sub.run_id}/1", "runlane.fencing_token": 1,
        "runlane.worker_id": row.worker_id, "runlane.sandbox_id": f"{sub.run_id}-1",
        "runlane.tenant": "acme", "runlane.queue": "default",
        "runlane.ended": "pull_request"})
    assert_has(submit, {"runlane.task_id": sub.task_id, "runlane.run_id": sub.run_id,
                        "runlane.created": True})
    for start in starts:
        attributes = dict(start.attributes or {})
        assert attributes["runlane.sandbox_id"] == f"{sub.run_id}-1"
        assert attributes["runlane.sandbox.mode"] == lane.settings.sandbox
        assert isinstance(attributes["runlane.sandbox.pid"], int)
    # The admission is the claim's, and the attempt starts with it.
    assert stage["runlane.admission"].start_time == attempt.start_time
    assert dict(stage["runlane.pull_request"].attributes or {})["runlane.number"] == 1
    # The agent's control lines are events of the agent's stage.
    events = [(e.name, dict(e.attributes or {})) for e in stage["runlane.agent"].events]
    assert events == [
        ("tool_call", {"runlane.tool_call_id": "call-7", "runlane.tool_name": "edit",
                       "runlane.shell": False}),
        ("tool_call_ended", {"runlane.tool_call_id": "call-7", "runlane.tool_name": "edit",
                             "runlane.shell": False, "runlane.seconds": 0.5}),
        ("iteration", {}),
        ("progress", {"runlane.message": "half way"})]
    # The agent joins the trace under the attempt; the task keeps the submit's context.
    assert agent_env(tmp_path, sub.run_id, 1)["TRACEPARENT"] == traceparent_of(attempt)
    assert stored_traceparent(lane, sub.task_id) == traceparent_of(submit)


def test_a_failing_stage_is_an_error_of_its_span_and_of_the_attempt(
        lane: Runlane, remote: Path, tmp_path: Path, spans: InMemorySpanExporter) -> None:
    lane.submit("acme", str(remote), "improve the code")
    assert run_worker(lane, tmp_path, "touch a", verify_command="exit 1") == [
        "VERIFIER_FAILED"]
    named = by_name(spans)
    [attempt] = named["runlane.attempt"]
    [verify] = named["runlane.verify"]
    assert dict(verify.attributes or {})["runlane.exit_code"] == 1
    assert attempt.status.status_code.name == "ERROR"
    assert dict(attempt.attributes or {})["runlane.ended"] == "VERIFIER_FAILED"
    assert "runlane.push" not in named


def test_without_tracing_nothing_is_recorded_and_a_stored_context_still_reaches_the_agent(
        lane: Runlane, remote: Path, tmp_path: Path) -> None:
    untraced = lane.submit("acme", str(remote), "one")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_provider(provider)
    try:
        traced = lane.submit("acme", str(remote), "two")
    finally:
        tracing.set_provider(None)
    [submit] = exporter.get_finished_spans()
    assert not tracing.enabled()
    assert stored_traceparent(lane, untraced.task_id) is None
    assert run_worker(lane, tmp_path, AGENT) == ["pull_request", "pull_request"]
    assert exporter.get_finished_spans() == (submit,)  # the worker recorded nothing
    assert "TRACEPARENT" not in agent_env(tmp_path, untraced.run_id, 1)
    assert agent_env(tmp_path, traced.run_id, 1)["TRACEPARENT"] == traceparent_of(submit)


def test_a_submit_over_http_joins_the_callers_trace(db_url: str, tmp_path: Path,
                                                    spans: InMemorySpanExporter) -> None:
    from fastapi.testclient import TestClient

    from runlane.http.app import create_app

    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with Runlane(settings=Settings(database_url=db_url)) as lane, \
            TestClient(create_app(lane)) as client:
        token = lane.create_token(role="submit", tenant="acme").token
        auth = {"Authorization": f"Bearer {token}"}
        answer = client.post("/v1/tasks", json={"repo": "/srv/git/a.git", "prompt": "p"},
                             headers={**auth, "traceparent": caller})
        assert answer.status_code == 201, answer.text
        batch = client.post("/v1/tasks/batch", headers=auth,
                            json=[{"repo": "/srv/git/a.git", "prompt": "q"}])
        assert batch.status_code == 201, batch.text
    one, other = by_name(spans)["runlane.submit"]
    assert one.parent is not None and one.context is not None
    assert f"{one.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{one.parent.span_id:016x}" == "b7ad6b7169203331"
    assert other.parent is None  # no header: a trace of its own


# --- configuration ---------------------------------------------------------------------


def _exporters(provider: TracerProvider) -> list[str]:
    processors = provider._active_span_processor._span_processors  # what it exports to
    return [type(getattr(p, "span_exporter", None) or getattr(p, "_exporter", None)
                 or p).__name__ for p in processors]


def test_tracing_is_off_unless_an_exporter_or_an_endpoint_is_named() -> None:
    assert tracing.build_provider({}) is None
    assert tracing.build_provider({"OTEL_TRACES_EXPORTER": ""}) is None
    assert tracing.build_provider({"OTEL_SDK_DISABLED": "true",
                                   "OTEL_TRACES_EXPORTER": "console"}) is None
    recording = tracing.build_provider({"OTEL_TRACES_EXPORTER": "none"})
    assert recording is not None and _exporters(recording) == []
    by_endpoint = tracing.build_provider({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert by_endpoint is not None and len(_exporters(by_endpoint)) == 1
    both = tracing.build_provider({"OTEL_TRACES_EXPORTER": "otlp,console"})
    assert both is not None and len(_exporters(both)) == 2
    assert both.resource.attributes["service.name"] == "runlane"
    named = tracing.build_provider({"OTEL_TRACES_EXPORTER": "none",
                                    "OTEL_SERVICE_NAME": "agents-prod"})
    assert named is not None and named.resource.attributes["service.name"] != "runlane"
    for provider in (recording, by_endpoint, both, named):
        provider.shutdown()
    with pytest.raises(SettingsInvalid, match="'jaeger' is not one of"):
        tracing.build_provider({"OTEL_TRACES_EXPORTER": "jaeger"})
    with pytest.raises(SettingsInvalid, match="http/json"):
        tracing.build_provider({"OTEL_TRACES_EXPORTER": "otlp",
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_a_bad_exporter_is_one_line_of_bad_input(tmp_path: Path) -> None:
    from .support import one_line_error

    result = subprocess.run(
        [sys.executable, "-m", "runlane", "--database-url", f"sqlite:///{tmp_path}/r.db",
         "submit", "--no-repo-check", "--tenant", "a", "--repo", "/srv/x.git", "--prompt", "p"],
        env=cli_env(tmp_path, OTEL_TRACES_EXPORTER="zipkin"), capture_output=True, text=True,
        timeout=60)
    one_line_error(result, 2, "OTEL_TRACES_EXPORTER")


# --- across processes: a worker killed with SIGKILL --------------------------------------


def _only(spans: list[CollectedSpan], name: str) -> CollectedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [(s.name, s.parent_span_id) for s in spans]
    return found[0]


def test_a_retry_after_a_sigkill_is_a_second_attempt_span_in_the_same_trace(
        db_url: str, tmp_path: Path, remote: Path) -> None:
    """The submit (`runlane submit`) and two `runlane worker` processes export over
    OTLP/HTTP to a collector on a real socket. The first worker dies by SIGKILL while
    its agent runs: its attempt span never ends (never exported), but the stages it
    ended went out (OTEL_BSP_SCHEDULE_DELAY), under the span the agent was given. The
    reaper requeues; the second worker's attempt is a span of the same trace."""
    store = Store(db_url, retry_policy=RetryPolicy(base_seconds=0.1, max_seconds=0.2))
    agent = ("env > \"$RUNLANE_ARTIFACTS_DIR/env-$RUNLANE_ATTEMPT.txt\"; "
             "touch \"$RUNLANE_ARTIFACTS_DIR/started\"; "
             "if [ \"$RUNLANE_ATTEMPT\" = 1 ]; then sleep 60; fi; echo x > x.txt")
    processes: list[subprocess.Popen[bytes]] = []
    with Collector() as collector:
        env = cli_env(tmp_path, RUNLANE_ARTIFACTS_DIR=str(tmp_path / "artifacts"),
                      RUNLANE_WORKSPACE_DIR=str(tmp_path / "workspaces"),
                      RUNLANE_LEASE_TTL_SECONDS="1.5", RUNLANE_HEARTBEAT_SECONDS="0.3",
                      RUNLANE_RETRY_BASE_SECONDS="0.1", RUNLANE_RETRY_MAX_SECONDS="0.2",
                      RUNLANE_AGENT_TERM_GRACE_SECONDS="0.5",
                      OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                      OTEL_BSP_SCHEDULE_DELAY="50")
        runlane = [sys.executable, "-m", "runlane", "--database-url", db_url]

        def worker(*args: str) -> subprocess.Popen[bytes]:
            process = subprocess.Popen([*runlane, "worker", "--agent-command", agent, *args],
                                       cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            processes.append(process)
            return process

        try:
            sub = json.loads(subprocess.run(
                [*runlane, "submit", "--no-repo-check",
                           "--tenant", "acme", "--repo", str(remote), "--prompt",
                 "p", "--json"], env=env, capture_output=True, check=True, timeout=60).stdout)
            submit = _only(collector.spans(), "runlane.submit")  # exported at its exit
            victim = worker()
            started = tmp_path / "artifacts" / sub["run_id"] / "1" / "started"
            wait_until(started.exists, "attempt 1's agent to run")
            first = agent_env(tmp_path, sub["run_id"], 1)["TRACEPARENT"].split("-")
            assert first[1] == submit.trace_id
            wait_until(lambda: any(s.name == "runlane.clone" and s.parent_span_id == first[2]
                                   for s in collector.spans()), "attempt 1's clone span")
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)

            def requeued() -> bool:
                store.reap_expired_leases()
                return str(run_row(store, sub["run_id"]).status) == "QUEUED"

            wait_until(requeued, "the reaper to requeue the run")
            assert worker("--exit-when-idle").wait(timeout=90) == 0
        finally:
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()
            for pid in processes_in(tmp_path / "workspaces"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # an orphaned agent (none in a sandbox)
            store.close()
        spans = collector.spans()
    assert str(run_row(store, sub["run_id"]).status) == "SUCCEEDED"
    assert {s.trace_id for s in spans} == {submit.trace_id}  # one trace, end to end
    retry = _only(spans, "runlane.attempt")  # attempt 1's never ended
    assert retry.parent_span_id == submit.span_id
    assert retry.attributes["runlane.attempt_no"] == 2
    assert retry.attributes["runlane.fencing_token"] == 2
    assert retry.attributes["runlane.ended"] == "pull_request"
    second = agent_env(tmp_path, sub["run_id"], 2)["TRACEPARENT"].split("-")
    assert second[1:3] == [submit.trace_id, retry.span_id]
    assert first[2] != retry.span_id
    parents = defaultdict(set)
    for span in spans:
        parents[span.name].add(span.parent_span_id)
    # Attempt 1's stages that ended before the kill, under its span; attempt 2's all.
    assert parents["runlane.clone"] == {first[2], retry.span_id}
    assert parents["runlane.admission"] == {first[2], retry.span_id}
    for name in ("runlane.agent", "runlane.push", "runlane.pull_request"):
        assert parents[name] == {retry.span_id}, name
