"""The pure domain: states, reason codes, retry policy and task validation. No I/O here."""
