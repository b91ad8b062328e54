"""The worker: claim, heartbeat, drive attempts, finalize exactly once, drain."""
