"""Telemetry: the JSON-lines event log (events) and the per-rank Prometheus endpoint (metrics)."""
