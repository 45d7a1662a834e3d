"""evflow.transport layer."""
