"""evflow.topology layer."""
