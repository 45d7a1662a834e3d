"""evflow.wire layer."""
