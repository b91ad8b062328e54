"""Observability: what runlane tells an operator beyond its logs (metrics, traces)."""
