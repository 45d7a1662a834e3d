"""Launchers start one agent per host: local fork, ssh, or Slurm's srun/sbatch.

A launcher only starts and stops agent processes; what runs on a host (its devices)
is the agent's business, told over the control bus.
"""

from __future__ import annotations

from evflow.topology.launch.base import AgentHandle, Launcher, get_launcher

__all__ = ["AgentHandle", "Launcher", "get_launcher"]
