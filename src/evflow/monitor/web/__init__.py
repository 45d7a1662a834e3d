"""The web dashboard: run page, QC viewer, quality summary and /metrics (starlette)."""

from __future__ import annotations

from evflow.monitor.web.server import Dashboard, start_dashboard

__all__ = ["Dashboard", "start_dashboard"]
