"""Schemathesis: requests generated from ``/openapi.json`` against a real `runlane serve`
(one per engine) with an admin token: no 5xx, and every response has a documented
status, content type and a body that matches its schema. The SSE stream (it never
ends) is left out; its JSON twin ``/v1/events/page`` is in. Examples per operation
are few (RUNLANE_SCHEMATHESIS_EXAMPLES, default 15) so that this runs in well under a
minute."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from .conftest import migrated_sqlite, truncate_pg
from .http_support import Served, make_token, serve

EXAMPLES = int(os.environ.get("RUNLANE_SCHEMATHESIS_EXAMPLES", "15"))
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served_api(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, str]]:
    directory = tmp_path_factory.mktemp("schemathesis")
    if request.param == "sqlite":
        url = migrated_sqlite(directory / "runlane.db")
    else:
        url = str(request.getfixturevalue("pg_url"))
        truncate_pg(url)
    with serve(url, directory) as server:
        yield server, make_token(url, "admin")


def test_the_api_keeps_its_openapi_document(served_api: tuple[Served, str]) -> None:
    """Each operation's examples (Schemathesis' strategies run by Hypothesis; its
    pytest plugin is not used, it does not load under this pytest); every failure of
    every operation is reported."""
    server, token = served_api
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: dict[str, str] = {}
    operations = 0
    for result in schema.exclude(path="/v1/events").get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            case.call_and_validate(base_url=server.url,
                                   headers={"Authorization": f"Bearer {token}"},
                                   checks=CHECKS, timeout=30)

        try:
            call()
        except (Exception, BaseExceptionGroup) as exc:  # every operation's, reported below
            parts = [str(e) for e in getattr(exc, "exceptions", ())] or [str(exc)]
            failures[operation.label] = "\n".join(parts)[:3000]
    assert operations >= 15
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
