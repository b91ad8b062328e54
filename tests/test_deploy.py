"""The deployable examples in deploy/: Prometheus's alert rules pass `promtool check
rules` and their unit tests (`promtool test rules`: each alert fires on the series
that should fire it, and only on those), and every metric the rules and the Grafana
dashboard name is one runlane exposes. (The dashboard's metrics are also checked
against a real scrape: tests/test_metrics_scrape.py.) promtool comes with Debian's
`prometheus` package (`make test` and .ci/run install it); without it these tests are
skipped, loudly, except on CI (RUNLANE_REQUIRE_POSTGRES=1), where they fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from prometheus_client import Metric

from runlane.observability import metrics
from runlane.observability.gauges import DatabaseGauges

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "runlane.json"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = ("promtool is missing (Debian: apt-get install --no-install-recommends "
                  "prometheus): the alert rules in deploy/prometheus are NOT checked")
        if os.environ.get("RUNLANE_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"on CI, {reason}")
        warnings.warn(f"SKIPPING: {reason}", stacklevel=1)
        pytest.skip(f"SKIPPING: {reason}")
    return found


def test_the_alert_rules_pass_promtool() -> None:
    checked = subprocess.run([promtool(), "check", "rules", str(RULES)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout + checked.stderr


def test_each_alert_fires_on_its_series_and_only_then() -> None:
    tested = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name],
                            capture_output=True, text=True, timeout=60, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = set(re.findall(r"^\s*- alert: (\w+)", RULES.read_text(), re.M))
    assert len(alerts) == 5
    assert alerts <= set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))


def exposed() -> set[str]:
    """Every sample name runlane can expose: this process's families and the
    database's gauges (described without a database)."""
    families: list[Metric] = [*metrics._m().registry.collect(),
                              *DatabaseGauges.describe(None)]  # type: ignore[arg-type]
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {family.name + suffix for family in families
            for suffix in ["", *suffixes.get(family.type, [])]}


def named(expressions: list[str]) -> set[str]:
    return {n for e in expressions for n in re.findall(r"\brunlane_[a-z_]+", e)}


def test_the_rules_and_the_dashboard_name_only_metrics_runlane_exposes() -> None:
    rules = named(re.findall(r"expr: (.*(?:\n {10,}.*)*)", RULES.read_text()))
    document = json.loads(DASHBOARD.read_text())
    panels = [p for p in document["panels"] if p["type"] != "row"]
    drawn = named([t["expr"] for p in panels for t in p["targets"]])
    assert len(rules) >= 5 and len(drawn) >= 20
    assert not rules - exposed(), rules - exposed()
    assert not drawn - exposed(), drawn - exposed()
    # Every panel reads the dashboard's one data source input and has a title.
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["title"] for p in panels)
    assert len({p["id"] for p in document["panels"]}) == len(document["panels"])
