"""``runlane top``: a live full-screen view of queues, tenants, workers and the latest
failures. ``snapshot``: one frame's figures from the database or the HTTP API, as one
model; ``render``: that model as Rich tables; ``screen``: the live loop (refresh, keys,
the terminal restored on every way out). The command is ``runlane.cli_top``."""
