"""Workloads, the HTTP load runner, metrics, reports and plots."""
