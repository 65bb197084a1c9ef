"""Test hosts on one machine: a bridge, and per host a network namespace with its own address on it.

Each host is a network namespace joined to the bridge by a veth pair; the bridge itself holds the
first address of the subnet (where a controller on the machine answers). The namespaces get no
default route, so their traffic stays between them and the bridge. Everything created here is
removed on exit (deleting a namespace deletes its veth pair, and the bridge is deleted by name).

    with NodeNetwork(["n1", "n2"]) as network:
        network.addresses      # {"n1": "10.x.y.11", "n2": "10.x.y.12"}
        network.gateway        # "10.x.y.1", on the bridge
        network.wrap("n1", ["slurmd", "-D"])   # the command run inside n1 (see `wrap`)

Needs root and iproute2 (`ip`, `apt-get install iproute2`), and nsenter/unshare/mount/hostname
from util-linux (always on Debian).
"""

from __future__ import annotations

import ipaddress
import os
import random
import subprocess
from pathlib import Path

INSTALL_HINT = "apt-get install -y --no-install-recommends iproute2 (as root; .ci/run does it)"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the machine already has a route or an address in."""
    used = []
    for line in (
        _ip("-4", "route", "show", "table", "all").stdout.splitlines()
        + _ip("-4", "-o", "addr").stdout.split("inet ")[1:]
    ):
        word = line.split()[0]
        try:
            used.append(ipaddress.ip_network(word if word != "default" else "0.0.0.0/32", strict=False))
        except ValueError:
            pass
    return used


def free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps nothing the machine routes."""
    used = _used_networks()
    for _ in range(200):
        candidate = ipaddress.ip_network(f"10.{rng.randrange(100, 250)}.{rng.randrange(1, 255)}.0/24")
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return candidate
    raise RuntimeError("no free /24 in 10.0.0.0/8 for the test bridge")


class NodeNetwork:
    """A bridge and one network namespace per host name; removed on exit."""

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = list(hosts)
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"saebr{tag}"
        self.namespaces = {host: f"sae{tag}-{host}" for host in self.hosts}
        subnet = free_subnet(random.Random(os.getpid()))
        hosts_addresses = list(subnet.hosts())
        self.prefixlen = subnet.prefixlen
        self.gateway = str(hosts_addresses[0])
        self.addresses = {host: str(hosts_addresses[10 + i]) for i, host in enumerate(self.hosts)}
        self._created: list[tuple[str, str]] = []  # ("netns"|"link", name), to remove in reverse

    def __enter__(self) -> NodeNetwork:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            namespace, outside = self.namespaces[host], f"{self.bridge}v{i}"
            _ip("netns", "add", namespace)
            self._created.append(("netns", namespace))
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{self.addresses[host]}/{self.prefixlen}", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def hosts_file(self, controller: str) -> str:
        """/etc/hosts text naming every host and `controller` (the bridge's address)."""
        lines = ["127.0.0.1 localhost", f"{self.gateway} {controller}"]
        lines += [f"{address} {host}" for host, address in self.addresses.items()]
        return "\n".join(lines) + "\n"

    def wrap(self, host: str, command: list[str], hosts_fpath: Path) -> list[str]:
        """`command` run inside `host`: its network namespace, its own hostname (a new UTS namespace)
        and `hosts_fpath` bind-mounted on /etc/hosts in a private mount namespace, so that the
        host names resolve there as on a cluster; the machine's own /etc/hosts is untouched."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        # nsenter, not `ip netns exec`: that one mounts a new /sys, which hides /sys/fs/cgroup (slurmd needs it).
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[host]}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            host,
            str(hosts_fpath),
            *command,
        ]

    def stop(self) -> None:
        for kind, name in reversed(self._created):
            if kind == "netns":
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)
        self._created = []
