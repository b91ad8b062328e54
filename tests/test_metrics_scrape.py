"""Seed 000 §31's metrics scraped from real processes while runs go through them, on
SQLite and PostgreSQL: a worker (`--metrics-port`), `runlane maintain`
(`--metrics-port`) and `runlane serve` (`/metrics`, an admin token). Each of the
fourteen is exposed, and each moves where its thing happens: a claim that finds
nothing it may take (claim_empty), a submit the policy denies (admission_denied), two runs of a
tenant at its limit in one claim (capacity_denied{dimension="tenant"}), an agent's
429 (retry{reason_code="PROVIDER_RATE_LIMIT"}), a cancel (cancellation latency,
observed once), a killed worker's lease (lease_expired), and the database's gauges.
`runlane up --metrics-port` sums the counts of its two worker processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runlane.api import Runlane
from runlane.store.store import Store

from .conftest import migrated_sqlite
from .http_support import free_port, make_token, serve, wait_until
from .metrics_support import SEED_METRICS, Scrape, scrape, try_scrape
from .support import bare_remote, cli_env, run_row

ROOT = Path(__file__).resolve().parent.parent

POLICY = """
allow_unknown_tenants = false

[tenants.acme]
max_active = 1
daily_model_budget_usd = 1.0

[tenants.beta]
"""
# What the agent does is in the prompt: a 429 on its first attempt, sleep until it is
# cancelled or killed, or finish at once (no change: the run succeeds, no_changes).
AGENT = """#!/bin/sh
case "$RUNLANE_PROMPT" in
  ratelimit)
    if [ "$RUNLANE_ATTEMPT" = 1 ]; then
      echo '{"runlane": "fail", "reason_code": "PROVIDER_RATE_LIMIT",' \
           '"retry_after_seconds": 0.1, "message": "429 Too Many Requests"}'
      exit 1
    fi ;;
  sleep) exec sleep 600 ;;
  change) echo "changed by the agent" > change.txt ;;
esac
echo '{"runlane": "cost", "usd": 0.25}'
exit 0
"""
FAST = {  # short leases (a killed worker's expires soon; a loaded machine's beats in
    # time: the counts are exact), short backoff
    "RUNLANE_LEASE_TTL_SECONDS": "4", "RUNLANE_HEARTBEAT_SECONDS": "0.5",
    "RUNLANE_RETRY_BASE_SECONDS": "0.1", "RUNLANE_RETRY_MAX_SECONDS": "0.2",
    "RUNLANE_AGENT_TERM_GRACE_SECONDS": "0.5", "RUNLANE_REAPER_INTERVAL_SECONDS": "0.2",
    "RUNLANE_SANDBOX": "off", "RUNLANE_METRICS_CACHE_SECONDS": "0",
}


class Processes:
    """runlane subprocesses of one test, each with its log, killed afterwards."""

    def __init__(self, db_url: str, tmp_path: Path) -> None:
        self.db_url = db_url
        self.tmp_path = tmp_path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        self.env.update({"RUNLANE_FORGE_DIR": str(tmp_path / "forge"),
                         "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
                         "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"), **FAST})
        self.started: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp_path / f"{args[0]}-{len(self.started)}.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "runlane", "--database-url", self.db_url, *args],
                cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
        self.started.append((process, log))
        return process

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                         for _, log in self.started)

    def stop(self) -> None:
        for process, _ in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in self.started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def processes(db_url: str, tmp_path: Path) -> Iterator[Processes]:
    running = Processes(db_url, tmp_path)
    yield running
    running.stop()


@pytest.fixture
def agent(tmp_path: Path) -> str:
    path = tmp_path / "agent.sh"
    path.write_text(AGENT)
    path.chmod(0o755)
    return str(path)


def dashboard_metrics() -> set[str]:
    """Every metric named by a query of a panel of deploy/grafana/runlane.json."""
    document = json.loads((ROOT / "deploy" / "grafana" / "runlane.json").read_text())
    exprs = [target["expr"] for panel in document["panels"]
             for target in panel.get("targets", [])]
    assert exprs
    return {name for expr in exprs for name in re.findall(r"\brunlane_[a-z_]+", expr)}


def status_of(store: Store, run_id: str) -> str:
    return str(run_row(store, run_id).status)


def scraped(url: str, what: str, check: Callable[[Scrape], Any], *,
            token: str | None = None, timeout: float = 60.0) -> Scrape:
    """The first scrape of ``url`` for which ``check`` holds."""
    last: list[Scrape | None] = [None]

    def holds() -> bool:
        last[0] = got = try_scrape(url, token)
        return got is not None and bool(check(got))

    try:
        wait_until(holds, what, timeout=timeout)
    except AssertionError:
        text = last[0].text if last[0] is not None else "(nothing listening)"
        raise AssertionError(f"{what}; last scrape of {url}:\n{text[-4000:]}") from None
    assert last[0] is not None
    return last[0]


def test_the_seed_metrics_move_as_runs_go_through_real_processes(
        db_url: str, tmp_path: Path, processes: Processes, agent: str) -> None:
    repo = str(bare_remote(tmp_path))
    with Runlane(db_url) as lane:
        lane.apply_policy(POLICY, source="test")
    worker_port, maintain_port, doomed_port = free_port(), free_port(), free_port()
    processes.start("worker", "--agent-command", agent, "--concurrency", "2",
                    "--metrics-port", str(worker_port))
    doomed = processes.start("worker", "--agent-command", agent, "--queue", "doomed",
                             "--metrics-port", str(doomed_port))
    processes.start("maintain", "--metrics-port", str(maintain_port))
    worker_url = f"http://127.0.0.1:{worker_port}/metrics"
    maintain_url = f"http://127.0.0.1:{maintain_port}/metrics"
    store = Store(db_url)
    admin = make_token(db_url, "admin")
    with serve(db_url, tmp_path, env={"RUNLANE_METRICS_CACHE_SECONDS": "0"}) as served, \
            served.client(admin) as api:
        serve_url = f"{served.url}/metrics"
        try:
            # A tenant the policy does not list: denied at submit, in `serve`.
            denied = api.post("/v1/tasks", json={"tenant": "stranger", "repo": repo,
                                                 "prompt": "ok"})
            assert denied.status_code == 201 and denied.json()["status"] == "POLICY_DENIED"
            served_now = scrape(serve_url, admin)
            assert served_now.value("runlane_scheduler_admission_denied_total") == 1
            assert served_now.value("runlane_policy_decisions_total", stage="submit",
                                    action="deny", reason_code="TENANT_NOT_ALLOWED") == 1

            # Two runs of acme (max_active 1) in one batch: the idle worker's claim of
            # two takes one, the other waits for the tenant's slot.
            batch = api.post("/v1/tasks/batch", json=[
                {"tenant": "acme", "repo": repo, "prompt": "sleep"},
                {"tenant": "acme", "repo": repo, "prompt": "ok"}])
            assert batch.status_code == 201, batch.text
            sleeper, quick = batch.json()
            assert scrape(serve_url, admin).value(
                "runlane_scheduler_admission_accepted_total") == 2
            scraped(worker_url, "a claim held back by the tenant's limit",
                    lambda s: s.value("runlane_scheduler_capacity_denied_total",
                                      dimension="tenant") >= 1)
            # The waiting run's lane is in view: the worker's next claim comes back empty.
            scraped(worker_url, "an empty claim",
                    lambda s: s.value("runlane_scheduler_claim_empty_total",
                                      queue="default") >= 1)
            wait_until(lambda: status_of(store, sleeper["run_id"]) == "RUNNING",
                       "the sleeping agent", timeout=60)
            cancelled = api.post(f"/v1/tasks/{sleeper['task_id']}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            wait_until(lambda: status_of(store, sleeper["run_id"]) == "CANCELLED"
                       and status_of(store, quick["run_id"]) == "SUCCEEDED",
                       "the cancel and the other acme run", timeout=60)

            # An agent's 429: its first attempt fails PROVIDER_RATE_LIMIT, is retried.
            # And a change: pushed and proposed (side effects), a cost in beta's day.
            limited, changed = (api.post("/v1/tasks", json={
                "tenant": "beta", "repo": repo, "prompt": prompt}).json()
                for prompt in ("ratelimit", "change"))
            wait_until(lambda: status_of(store, limited["run_id"]) == "SUCCEEDED"
                       and status_of(store, changed["run_id"]) == "SUCCEEDED",
                       "the rate-limited run (second attempt) and the change", timeout=60)
            worker = scraped(worker_url, "the worker's counts of those runs",
                             lambda s: s.value("runlane_scheduler_run_duration_seconds_count",
                                               status="SUCCEEDED") >= 3)
            assert worker.value("runlane_scheduler_retry_total",
                                reason_code="PROVIDER_RATE_LIMIT") == 1
            assert worker.value("runlane_attempts_total", outcome="PROVIDER_RATE_LIMIT") == 1
            assert worker.value("runlane_scheduler_cancellation_latency_seconds_count") == 1
            assert worker.value("runlane_scheduler_cancellation_latency_seconds_sum") > 0
            assert worker.value("runlane_scheduler_run_duration_seconds_count",
                                status="CANCELLED") == 1
            assert worker.value("runlane_scheduler_claim_success_total",
                                queue="default") == 5  # acme 2, the 429 run twice, change
            assert worker.value("runlane_cost_usd_total", tenant="acme") == 0.25
            assert worker.value("runlane_cost_usd_total", tenant="beta") == 0.5
            for effect in ("push_branch", "pull_request"):
                assert worker.value("runlane_side_effects_total", kind=effect,
                                    result="performed") == 1
            assert worker.value("runlane_db_claim_seconds_count") >= 4
            assert worker.value("runlane_db_heartbeat_seconds_count") >= 1

            # A worker killed while its agent runs: the reaper expires its lease.
            doomed_run = api.post("/v1/tasks", json={"tenant": "beta", "repo": repo,
                                                     "prompt": "sleep", "queue": "doomed"}
                                  ).json()
            wait_until(lambda: status_of(store, doomed_run["run_id"]) == "RUNNING",
                       "the doomed worker's agent", timeout=60)
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
            maintained = scraped(maintain_url, "the reaper's expired lease",
                                 lambda s: s.value("runlane_scheduler_lease_expired_total")
                                 == 1)
            assert maintained.value("runlane_scheduler_retry_total",
                                    reason_code="WORKER_LOST") == 1
            assert maintained.value("runlane_attempts_total", outcome="WORKER_LOST") == 1

            # The database's gauges, as `serve` reads them: the doomed run queued again
            # with nobody to claim it, nothing leased.
            gauges = scraped(
                serve_url, "the requeued run in the gauges",
                lambda s: s.value("runlane_scheduler_queue_depth", queue="doomed") == 1
                and s.value("runlane_scheduler_queue_oldest_ready_age_seconds",
                            queue="doomed") > 0
                and s.value("runlane_scheduler_lease_active") == 0, token=admin)
            assert gauges.value("runlane_scheduler_queue_depth", queue="default") == 0
            assert gauges.value("runlane_scheduler_worker_active") >= 1
            assert len(gauges.labels("runlane_scheduler_worker_heartbeat_lag_seconds",
                                     "worker_id")) >= 1
            assert gauges.value("runlane_tenant_budget_usd", tenant="acme") == 1.0
            assert gauges.value("runlane_tenant_spend_today_usd", tenant="acme") == 0.25

            # Every one of the fourteen, across the three endpoints; and every metric a
            # panel of the Grafana dashboard draws.
            seen = [worker, maintained, gauges]
            missing = [name for name in SEED_METRICS if not any(s.has(name) for s in seen)]
            assert not missing, missing
            drawn = dashboard_metrics()
            assert len(drawn) >= 20
            undrawn = sorted(name for name in drawn if not any(s.has(name) for s in seen))
            assert not undrawn, undrawn
        except BaseException:
            print(processes.logs(), served.stderr())
            raise
        finally:
            store.close()


def test_serve_metrics_need_an_admin_token(db_url: str, tmp_path: Path) -> None:
    """The figures are every tenant's: no token is 401, a tenant's token 403 (whatever
    its role), an admin's 200 in the Prometheus text format."""
    reader = make_token(db_url, "read", tenant="acme")
    submitter = make_token(db_url, "submit", tenant="beta")
    admin = make_token(db_url, "admin")
    with serve(db_url, tmp_path) as served:
        assert httpx.get(f"{served.url}/metrics").status_code == 401
        for token in (reader, submitter):
            refused = httpx.get(f"{served.url}/metrics",
                                headers={"Authorization": f"Bearer {token}"})
            assert refused.status_code == 403, refused.text
            assert "runlane_" not in refused.text
        ok = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {admin}"})
        assert ok.status_code == 200
        assert ok.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "runlane_scheduler_queue_depth" in ok.text


def test_up_serves_the_sum_of_its_worker_processes_on_one_port(
        db_url: str, tmp_path: Path, processes: Processes) -> None:
    """Two worker processes under `runlane up --metrics-port`: the claims each made are
    all in the one scrape (prometheus_client's multiprocess mode), with the gauges."""
    repo = str(bare_remote(tmp_path))
    port = free_port()
    processes.start("up", "--workers", "2", "--agent-command", "sleep 0.3",
                    "--metrics-port", str(port))
    url = f"http://127.0.0.1:{port}/metrics"
    store = Store(db_url)
    try:
        scraped(url, "runlane up's metrics", lambda s: s.has("runlane_scheduler_queue_depth"))
        with Runlane(db_url) as lane:
            runs: list[str] = []

            def both_workers_claimed() -> bool:  # submit until both have claimed
                runs.extend(s.run_id for s in lane.submit_batch(
                    [{"tenant": "acme", "repo": repo, "prompt": "p"}] * 2))
                workers = {a.worker_id for r in runs for a in lane.run(r).attempts}
                return len(workers) >= 2

            wait_until(both_workers_claimed, "claims by both worker processes",
                       timeout=60, interval=0.3)
            wait_until(lambda: all(status_of(store, r) == "SUCCEEDED" for r in runs),
                       "every run to succeed", timeout=120)
            claims = sum(len(lane.run(r).attempts) for r in runs)
        got = scraped(url, "every claim in the sum",
                      lambda s: s.value("runlane_scheduler_claim_success_total") == claims)
        assert got.value("runlane_scheduler_run_duration_seconds_count",
                         status="SUCCEEDED") == len(runs)
        assert got.value("runlane_attempts_total", outcome="SUCCEEDED") == len(runs)
        assert got.has("runlane_scheduler_worker_active")
    except BaseException:
        print(processes.logs())
        raise
    finally:
        store.close()


def test_a_metrics_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    db = migrated_sqlite(tmp_path / "runlane.db")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in (["worker", "--agent-command", "true"], ["maintain"]):
            done = subprocess.run(
                [sys.executable, "-m", "runlane", "--database-url", db, "--sandbox", "off",
                 *command, "--metrics-port", str(port)],
                capture_output=True, text=True, timeout=60, cwd=tmp_path,
                env=cli_env(tmp_path))
            assert done.returncode == 1, done.stderr
            assert "Traceback" not in done.stderr
            assert done.stderr.strip().splitlines()[-1] == (  # after SANDBOX=off's warnings
                f"error: cannot serve metrics on 127.0.0.1:{port}: Address already in use")
