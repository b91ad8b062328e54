from runlane.domain.states import RunStatus
from runlane.store.store import Store

from .support import submit


def test_submit_claim_complete(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1")
    assert lease.run_id == sub.run_id and lease.fencing_token == 1
    store.advance(lease, RunStatus.RUNNING)
    store.complete(lease)
    assert store.audit() == []
