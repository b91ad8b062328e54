"""Campaigns: what the stop rule adds to a run's completion, and the time to
create a 10,000-target campaign. Prints Markdown; writes nothing.

1. Completion: ``Store.complete`` of one lease (the worker's write of a run's success),
   timed per call, for runs of no campaign and for runs of a campaign with a stop
   rule (each completion then records the target's end, numbers the finish and reads
   the rule's window, in the same transaction), rounds alternated; p50 and p90.
   Also ``Store.fail`` (a failure: the same, plus the stop rule's verdict).
2. Create: ``parse_campaign`` of a 10,000-target TOML text, and ``Store.create_campaign``
   (the campaign row and 10,000 target rows in one transaction) on PostgreSQL.

    .venv/bin/python bench/campaigns.py [--runs 300] [--rounds 3] [--targets 10000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from runlane.domain.campaigns import parse_campaign
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskSpec
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.records import Lease
from runlane.store.store import Store

PG = os.environ.get("RUNLANE_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
DB = "runlane_bench_campaigns"


def fresh_pg() -> str:
    admin = PG.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DB}"')
    return admin.rsplit("/", 1)[0] + f"/{DB}"


def drop_pg() -> None:
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')


def migrated(url: str) -> Store:
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    return Store(url)


def campaign_text(name: str, n: int) -> str:
    targets = "".join(f'[[targets]]\nrepo = "/srv/git/{name}/r{i}.git"\nowner = "o{i % 50}"\n'
                      f'vars = {{team = "t{i % 7}"}}\n' for i in range(n))
    return (f'name = "{name}"\ntenant = "acme"\nprompt = "migrate {{repo}} for {{team}}"\n'
            f"{targets}[rollout]\ncanary = {n}\n[concurrency]\nmax_active = {n}\n"
            "per_repository = 1\n[stop]\nfailure_rate = 1.0\nwindow = 50\nmin_sample = 10\n")


def leases_plain(store: Store, n: int, tag: str) -> list[Lease]:
    store.submit([TaskSpec(tenant="acme", repo=f"/srv/git/plain/{tag}{i}.git", prompt="p")
                  for i in range(n)])
    return claim_all(store, n)


def leases_campaign(store: Store, n: int, tag: str) -> list[Lease]:
    store.create_campaign(parse_campaign(campaign_text(f"bench-{tag}", n)))
    store.campaign_pass()
    return claim_all(store, n)


def claim_all(store: Store, n: int) -> list[Lease]:
    leases: list[Lease] = []
    while len(leases) < n:
        got = store.claim("bench", limit=100, lease_ttl=600)
        if not got:
            raise RuntimeError(f"claimed {len(leases)} of {n}")
        leases.extend(got)
    for lease in leases:
        store.advance(lease, RunStatus.FINALIZING)
    return leases


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def completion(url_of: Callable[[], str], runs: int, rounds: int) -> list[str]:
    """Calls of both kinds interleaved one by one (the order flipped every pair), so a
    burst of load on the machine hits both alike; the added time is also given as the
    median of the pairs' differences."""
    rows = []
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        store = migrated(url_of())
        try:
            plain = leases_plain(store, runs, f"{r}p")
            ours = leases_campaign(store, runs, f"{r}c")
            half = runs // 2
            for i in range(runs):
                op = "complete" if i < half else "fail"
                pair = [("no campaign", plain[i]), ("campaign", ours[i])]
                for kind, lease in (pair if i % 2 else pair[::-1]):
                    started = time.perf_counter()
                    if op == "complete":
                        store.complete(lease)
                    else:
                        store.fail(lease, "AGENT_FAILED")
                    samples.setdefault((kind, op), []).append(
                        (time.perf_counter() - started) * 1000)
        finally:
            store.close()
    for op in ("complete", "fail"):
        base = samples[("no campaign", op)]
        for kind in ("no campaign", "campaign"):
            values = samples[(kind, op)]
            added = paired = mean_added = ""
            if kind == "campaign":
                added = f"{statistics.median(values) - statistics.median(base):+.3f}"
                mean_added = f"{statistics.fmean(values) - statistics.fmean(base):+.3f}"
                diffs = [v - b for v, b in zip(values, base, strict=True)]
                paired = f"{statistics.median(diffs):+.3f}"
            rows.append(f"| {op} | {kind} | {len(values)} | {statistics.median(values):.3f} | "
                        f"{pct(values, 90):.3f} | {statistics.fmean(values):.3f} | {added} | "
                        f"{mean_added} | {paired} |")
    return rows


def create(targets: int, rounds: int) -> list[str]:
    url = fresh_pg()
    store = migrated(url)
    rows = []
    try:
        for r in range(rounds):
            text = campaign_text(f"big{r}", targets)
            started = time.perf_counter()
            campaign = parse_campaign(text)
            parsed = time.perf_counter()
            made = store.create_campaign(campaign)
            written = time.perf_counter()
            again = store.create_campaign(campaign)
            replay = time.perf_counter()
            assert made.created and not again.created
            rows.append(f"| {r + 1} | {targets:,} | {parsed - started:.2f} | "
                        f"{written - parsed:.2f} | {written - started:.2f} | "
                        f"{replay - written:.2f} |")
    finally:
        store.close()
        drop_pg()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--targets", type=int, default=10_000)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    print(f"`python bench/campaigns.py --runs {args.runs} --rounds {args.rounds} --targets "
          f"{args.targets}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
          f"{commit}; {platform.machine()}, {os.cpu_count()} CPUs, PostgreSQL "
          f"on the same machine; load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} at start.\n")
    print("Completion of one run (ms per call; a campaign's runs record their end and "
          "evaluate the stop rule in the same transaction):\n")
    header = ("| call | runs | n | p50 ms | p90 ms | mean ms | p50 added | mean added |"
              " median of paired differences |\n"
              "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir()
                                     else None) as tmp:
        counter = iter(range(1000))
        print("PostgreSQL\n\n" + header)
        print("\n".join(completion(fresh_pg, args.runs, args.rounds)))
        drop_pg()
        print("\nSQLite (file on tmpfs)\n\n" + header)
        print("\n".join(completion(lambda: f"sqlite:///{tmp}/b{next(counter)}.db",
                                   args.runs, args.rounds)))
    print(f"\nCreating a {args.targets:,}-target campaign on PostgreSQL (seconds):\n")
    print("| round | targets | validate | write | total | same file again |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(create(args.targets, args.rounds)))


if __name__ == "__main__":
    main()
