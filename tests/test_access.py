"""Principal scoping of the facade (issue 23), on both engines: another tenant's task or
run is absent (NotFound, with the very message a missing id gets), a ``read``
principal never writes (Forbidden), a tenant's principal writes for its own tenant
only; and every refusal leaves the database as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.access import OPERATOR, Principal, Role
from runlane.domain.ids import new_id
from runlane.domain.tasks import TaskInvalid
from runlane.errors import Forbidden, NotFound, RunlaneError

from .support import database_state

ACME_SUBMIT = Principal(Role.SUBMIT, "acme", "t-acme")
ACME_READ = Principal(Role.READ, "acme", "t-acme-read")
GLOBEX_SUBMIT = Principal(Role.SUBMIT, "globex", "t-globex")
GLOBEX_READ = Principal(Role.READ, "globex", "t-globex-read")
ADMIN = Principal(Role.ADMIN, None, "t-admin")
REPO = "/srv/git/app.git"


@dataclass
class World:
    lane: Runlane
    url: str
    finished_task: str  # cancelled: a retry may run it again
    finished_run: str
    queued_task: str
    queued_run: str


@pytest.fixture
def world(db_url: str, clock: ManualClock) -> Iterator[World]:
    with Runlane(db_url, clock=clock) as lane:
        done = lane.submit("acme", REPO, "finished")
        lane.cancel(done.task_id)
        queued = lane.submit("acme", REPO, "queued", idempotency_key="k")
        lane.submit("globex", REPO, "theirs")
        yield World(lane, db_url, done.task_id, done.run_id, queued.task_id, queued.run_id)


Operation = Callable[[World, Principal, str | None], Any]
# Each operation on acme's rows; the third argument replaces the id (a missing one).
READS: dict[str, Operation] = {
    "run": lambda w, p, i: w.lane.run(i or w.queued_run, principal=p),
    "task": lambda w, p, i: w.lane.task(i or w.queued_task, principal=p),
}
WRITES_BY_ID: dict[str, Operation] = {
    "cancel": lambda w, p, i: w.lane.cancel(i or w.queued_task, principal=p),
    "retry": lambda w, p, i: w.lane.retry(i or w.finished_task, principal=p),
}
SUBMITS: dict[str, Operation] = {
    "submit": lambda w, p, _: w.lane.submit("acme", REPO, "more", principal=p),
    "submit_keyed": lambda w, p, _: w.lane.submit("acme", REPO, "queued", idempotency_key="k",
                                                  principal=p),
    "submit_batch": lambda w, p, _: w.lane.submit_batch(
        [{"tenant": "acme", "repo": REPO, "prompt": "a"}], principal=p),
}


@pytest.mark.parametrize("operation", [*READS, *WRITES_BY_ID])
@pytest.mark.parametrize("principal", [GLOBEX_SUBMIT, GLOBEX_READ],
                         ids=["globex-submit", "globex-read"])
def test_another_tenants_ids_are_absent_and_nothing_changes(world: World, operation: str,
                                                            principal: Principal) -> None:
    do = {**READS, **WRITES_BY_ID}[operation]
    before = database_state(world.url)
    missing = new_id()
    with pytest.raises(NotFound) as absent:
        do(world, OPERATOR, missing)
    try:
        do(world, principal, None)
    except Forbidden:
        # A read principal's write is refused before any lookup: that tells nothing
        # either (every id gets it).
        assert principal.role is Role.READ and operation in WRITES_BY_ID
    except NotFound as hidden:
        theirs = world.queued_run if operation == "run" else (
            world.finished_task if operation == "retry" else world.queued_task)
        assert str(hidden).replace(theirs, "ID") == str(absent.value).replace(missing, "ID")
        assert type(hidden) is type(absent.value)
    else:
        pytest.fail(f"{operation} of another tenant's row was answered")
    assert database_state(world.url) == before


@pytest.mark.parametrize("operation", [*WRITES_BY_ID, *SUBMITS])
def test_a_read_principal_never_writes(world: World, operation: str) -> None:
    do = {**WRITES_BY_ID, **SUBMITS}[operation]
    before = database_state(world.url)
    with pytest.raises(Forbidden, match="read token may not") as refused:
        do(world, ACME_READ, None)
    assert isinstance(refused.value, RunlaneError) and refused.value.exit_code == 2
    assert database_state(world.url) == before


@pytest.mark.parametrize("operation", list(SUBMITS))
def test_a_tenant_principal_submits_for_its_own_tenant_only(world: World,
                                                            operation: str) -> None:
    before = database_state(world.url)
    with pytest.raises(Forbidden, match="tenant 'globex'"):
        SUBMITS[operation](world, GLOBEX_SUBMIT, None)
    # A batch with one row of another tenant writes none of its rows.
    with pytest.raises(Forbidden):
        world.lane.submit_batch([{"tenant": "globex", "repo": REPO, "prompt": "ours"},
                                 {"tenant": "acme", "repo": REPO, "prompt": "not ours"}],
                                principal=GLOBEX_SUBMIT)
    assert database_state(world.url) == before


@pytest.mark.parametrize("field", ["depends_on", "parent_task_id"])
def test_a_task_cannot_name_another_tenants_task(world: World, field: str) -> None:
    before = database_state(world.url)
    value: Any = [world.queued_task] if field == "depends_on" else world.queued_task
    with pytest.raises(TaskInvalid, match="no task"):
        world.lane.submit("globex", REPO, "follow", principal=GLOBEX_SUBMIT, **{field: value})
    assert database_state(world.url) == before


@pytest.mark.parametrize("principal", [ACME_SUBMIT, ADMIN, OPERATOR],
                         ids=["acme-submit", "admin", "operator"])
def test_the_owner_and_an_admin_may_do_everything(world: World,
                                                  principal: Principal) -> None:
    assert world.lane.run(world.queued_run, principal=principal).tenant == "acme"
    assert world.lane.task(world.queued_task, principal=principal).runs[0].run_id \
        == world.queued_run
    replay = SUBMITS["submit_keyed"](world, principal, None)
    assert (replay.run_id, replay.created) == (world.queued_run, False)
    assert SUBMITS["submit"](world, principal, None).created
    assert SUBMITS["submit_batch"](world, principal, None)[0].created
    retried = world.lane.retry(world.finished_task, principal=principal)
    assert retried.retry_of_run_id == world.finished_run
    cancelled = world.lane.cancel(world.queued_task, principal=principal)
    assert cancelled.runs == {world.queued_run: "CANCELLED"}


def test_a_read_principal_reads_its_own_tenant(world: World) -> None:
    assert world.lane.run(world.queued_run, principal=ACME_READ).run_id == world.queued_run
    assert world.lane.task(world.finished_task, principal=ACME_READ).runs[0].status \
        == "CANCELLED"
