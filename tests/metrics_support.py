"""Scraping a real process's /metrics: the text parsed into samples, and the sum of the
samples of one name whose labels include the ones asked for."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Seed 000 §31's fourteen metrics, by their Prometheus names (docs/metrics.md).
SEED_METRICS = (
    "runlane_scheduler_admission_accepted_total",
    "runlane_scheduler_admission_denied_total",
    "runlane_scheduler_queue_depth",
    "runlane_scheduler_queue_oldest_ready_age_seconds",
    "runlane_scheduler_claim_success_total",
    "runlane_scheduler_claim_empty_total",
    "runlane_scheduler_lease_active",
    "runlane_scheduler_lease_expired_total",
    "runlane_scheduler_retry_total",
    "runlane_scheduler_run_duration_seconds",
    "runlane_scheduler_worker_active",
    "runlane_scheduler_worker_heartbeat_lag_seconds",
    "runlane_scheduler_capacity_denied_total",
    "runlane_scheduler_cancellation_latency_seconds",
)


class Scrape:
    """One scrape: every sample, and every metric family's name (with its samples'
    names: ``_total``, ``_bucket``, ``_count``...)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        self.families: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.families.add(family.name)
            for sample in family.samples:
                self.samples.append((sample.name, dict(sample.labels), float(sample.value)))
                self.families.add(sample.name)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels``."""
        return sum(v for n, got, v in self.samples
                   if n == name and all(got.get(k) == want for k, want in labels.items()))

    def labels(self, name: str, label: str) -> set[str]:
        return {got[label] for n, got, _ in self.samples if n == name and label in got}

    def has(self, name: str) -> bool:
        """A metric of this name was exposed (a counter by its ``_total`` name, a
        histogram by its own or its ``_count``)."""
        return name in self.families or f"{name}_count" in self.families


def scrape(url: str, token: str | None = None) -> Scrape:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url, headers=headers, timeout=10)
    response.raise_for_status()
    return Scrape(response.text)


def try_scrape(url: str, token: str | None = None) -> Scrape | None:
    """None while nothing listens yet."""
    try:
        return scrape(url, token)
    except httpx.TransportError:
        return None
