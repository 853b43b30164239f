"""Latency predictors (queue, prefill, transfer, TBT), the telemetry schema, calibration."""
