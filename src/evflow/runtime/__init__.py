"""evflow.runtime layer."""
