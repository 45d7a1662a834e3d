"""evflow.monitor layer."""
