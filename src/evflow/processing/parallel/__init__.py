"""evflow.processing.parallel layer."""
