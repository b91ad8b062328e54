"""Provider pauses and a provider's tokens per minute, fed by its runs' reports."""

from __future__ import annotations

from runlane.store.dialect_sql import GREATEST

# A provider paused until ``:until`` (now + its retry-after); a longer pause kept.
PROVIDER_PAUSE = """
INSERT INTO provider_pauses (provider, paused_until, run_id, updated_at)
VALUES (:provider, :until, :run_id, :now)
ON CONFLICT (provider) DO UPDATE
SET paused_until = excluded.paused_until, run_id = excluded.run_id,
    updated_at = excluded.updated_at
WHERE provider_pauses.paused_until < excluded.paused_until
"""
PAUSED_PROVIDERS = "SELECT provider FROM provider_pauses WHERE paused_until > :now"
# A provider's tokens per minute (``[providers.NAME] tokens_per_minute``), fed by its
# runs' cost reports: counted in a window of one clock minute (window_start) on the
# provider's one row; the report that brings the window to the budget pauses the
# provider until the window's end. Every SET reads the row as it was.
_TOKENS_IN_WINDOW = """CASE WHEN provider_pauses.window_start = excluded.window_start
        THEN provider_pauses.window_tokens + excluded.window_tokens
        ELSE excluded.window_tokens END"""
_PROVIDER_TOKENS = """
INSERT INTO provider_pauses (provider, paused_until, run_id, updated_at, window_start,
                             window_tokens)
VALUES (:provider,
        CASE WHEN CAST(:tokens AS bigint) >= CAST(:budget AS bigint)
             THEN CAST(:window_end AS double precision) ELSE 0 END,
        :run_id, :now, :window_start, :tokens)
ON CONFLICT (provider) DO UPDATE
SET window_tokens = """ + _TOKENS_IN_WINDOW + """,
    window_start = excluded.window_start,
    paused_until = CASE WHEN """ + _TOKENS_IN_WINDOW + """ >= CAST(:budget AS bigint)
                        THEN {greatest}(provider_pauses.paused_until,
                                        CAST(:window_end AS double precision))
                        ELSE provider_pauses.paused_until END,
    updated_at = excluded.updated_at
"""
PROVIDER_TOKENS = {dialect: _PROVIDER_TOKENS.format(greatest=greatest)
                   for dialect, greatest in GREATEST.items()}
