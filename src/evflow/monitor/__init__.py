"""Monitoring: the terminal progress bar, the metrics collector, /metrics and the web dashboard."""
