"""evflow.hlt layer."""
