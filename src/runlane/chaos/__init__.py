"""The fault and load harness (``runlane chaos``): real workers, real remotes, faults
on a seeded schedule, then every invariant checked. See docs/reliability.md."""
