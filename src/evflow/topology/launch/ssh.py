"""The ssh launcher: one agent per host, started with the system ``ssh`` client.

``ssh -o BatchMode=yes ... user@host 'env K=V <python> -m evflow.topology.launch._guard
-- <python> -m evflow agent ...'``: keys only (BatchMode never asks for a password),
no host-key prompts (the hosts are the farm's own), a bounded connect. The remote
command runs under the guard, which ends the agent's whole process tree when the ssh
connection ends for any reason (``terminate``, the controller killed, the link lost).

Keys and options come from ssh itself: ``~/.ssh/config`` and the agent, or a config
file named by ``EVFLOW_SSH_CONFIG`` (``ssh -F``), or ``EVFLOW_SSH_IDENTITY`` (``-i``).

ssh does not forward environment variables; ``env`` is put on the remote command line.
``PYTHONPATH`` is forwarded too when the host runs the controller's own interpreter
(hosts that share the controller's filesystem, e.g. network namespaces).
"""

from __future__ import annotations

import os
import shlex
import sys

from evflow.errors import ConfigurationError
from evflow.topology.launch._process import GuardedProcess, guarded
from evflow.transport.hosts import HostSpec

#: seconds ssh may take to open the TCP connection
CONNECT_TIMEOUT_S = 5
#: the remote side must report the command started within this (ssh + python start)
START_TIMEOUT_S = 30.0


class SshLauncher:
    name = "ssh"

    def __init__(
        self,
        ssh_config: str | None = None,
        identity_file: str | None = None,
        connect_timeout_s: int = CONNECT_TIMEOUT_S,
    ) -> None:
        self.ssh_config = ssh_config
        self.identity_file = identity_file
        self.connect_timeout_s = connect_timeout_s

    def ssh_argv(self, host: HostSpec) -> list[str]:
        """The ssh client's argv up to and including the destination."""
        if not host.ssh:
            raise ConfigurationError(
                f"host {host.name!r} has no ssh destination; add "
                f'ssh = "user@{host.address}" to its entry in the hosts file'
            )
        argv = ["ssh"]
        config = self.ssh_config or os.environ.get("EVFLOW_SSH_CONFIG")
        if config:
            argv += ["-F", config]
        identity = self.identity_file or os.environ.get("EVFLOW_SSH_IDENTITY")
        if identity:
            argv += ["-i", identity]
        argv += [
            "-T",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR",
            "-o", f"ConnectTimeout={self.connect_timeout_s}",
            # a dead link ends the client within ~3 s (the controller sees poll() end)
            "-o", "ServerAliveInterval=1",
            "-o", "ServerAliveCountMax=3",
        ]  # fmt: skip
        return [*argv, host.ssh]

    def start_command(
        self,
        host: HostSpec,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        capture_stdout: bool = False,
    ) -> GuardedProcess:
        """Run ``argv`` on ``host`` under the guard; return once it started there.

        Raises ConfigurationError naming the host and ssh's own error line when the host
        cannot be reached or the command cannot start.
        """
        remote_env = dict(env or {})
        if host.python == sys.executable and "PYTHONPATH" in os.environ:
            remote_env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
        remote = shlex.join(guarded(host.python, argv, remote_env))
        handle = GuardedProcess(
            host, [*self.ssh_argv(host), remote], what="ssh", capture_stdout=capture_stdout
        )

        def failure(code: int | None, line: str) -> ConfigurationError:
            if code == 255:
                return ConfigurationError(
                    f"host {host.name!r}: ssh {host.ssh} failed: {line} "
                    "(is sshd running there, and is your key in its authorized_keys?)"
                )
            status = "did not start" if code is None else f"ended at once (exit {code})"
            return ConfigurationError(
                f"host {host.name!r}: {argv[0]!r} {status} over ssh {host.ssh}: {line}"
            )

        handle.wait_started(START_TIMEOUT_S, failure)
        return handle

    def start_agent(
        self, host: HostSpec, agent_args: list[str], env: dict[str, str] | None = None
    ) -> GuardedProcess:
        return self.start_command(host, [host.python, "-m", "evflow", "agent", *agent_args], env)


LAUNCHER = SshLauncher()
