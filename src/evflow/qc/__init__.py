"""evflow.qc layer."""
