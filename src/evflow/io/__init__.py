"""evflow.io layer."""
