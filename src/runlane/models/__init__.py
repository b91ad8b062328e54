"""Typed results of the facade (pydantic models): what the Python API returns, the CLI
prints with ``--json`` and the HTTP API serialises, one model for all three. Import from
the submodules (``runlane.models.runs``, ``runlane.models.tokens``, ...)."""
