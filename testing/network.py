"""Hosts on one machine, for tests and drills: each a Linux network namespace with its own address
on one bridge and its own working folder, so that nothing is shared but what the network carries.
Faults come by the network (a host's link down, then up again: a partition) and by processes (a
host's processes killed, then started again).

The machine's own namespace is the flow's host, at the bridge's address. Needs root and
iproute2's `ip`; `unavailable()` says why not, for a test to skip with the reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"gfprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One namespace: `address` on the bridge, `folder` its own, `processes` it started."""

    name: str
    namespace: str
    link: str  # the bridge's end of its cable: down cuts the host off
    address: str
    folder: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, args: Sequence[str], env: dict[str, str] | None = None, log: str | None = None) -> subprocess.Popen:
        """Start `args` inside the host, in its folder and a session of its own; output to
        `log` in its folder (default: the program's name)."""
        output = (self.folder / (log or f"{Path(args[0]).name}.log")).open("ab")
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace, *args], cwd=self.folder, env=env,
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        output.close()
        self.processes.append(process)
        return process

    def cut(self) -> None:
        """Take the host off the network (its processes run on, reaching no one)."""
        _ip("link", "set", self.link, "down")

    def mend(self) -> None:
        _ip("link", "set", self.link, "up")

    def kill(self) -> None:
        """SIGKILL every process the host started, as when its machine dies."""
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.processes = []

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM every process the host started; SIGKILL what is left after `timeout_s`."""
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes = []


class Network:
    """A bridge in this namespace (the flow's host, at `address`) and hosts cabled to it."""

    def __init__(self, folder: Path):
        self.tag = f"gf{secrets.token_hex(3)}"  # interface names hold 15 characters
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250) + 1}"
        self.folder, self.bridge, self.address = folder, f"{self.tag}br", f"{self.subnet}.1"
        self.hosts: list[Host] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def host(self, name: str) -> Host:
        number = len(self.hosts) + 2
        namespace, outside, inside = f"{self.tag}-{name}", f"{self.tag}o{number}", f"{self.tag}i{number}"
        _ip("netns", "add", namespace)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", namespace, "addr", "add", f"{self.subnet}.{number}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        folder = self.folder / name
        folder.mkdir(parents=True, exist_ok=True)
        host = Host(name, namespace, outside, f"{self.subnet}.{number}", folder)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        """End every host's processes, then its namespace and cable; then the bridge."""
        for host in self.hosts:
            host.stop(timeout_s=10)
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
