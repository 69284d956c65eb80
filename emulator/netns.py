"""Network namespaces standing in for hosts, so the shards of one fleet (``flayer emulate --shard i/n``)
run from "machines" with their own addresses on this one: ``python -m emulator.netns up|down``.

``up --hosts N --prefix P`` makes a switch namespace ``P-sw`` holding a bridge, and N host namespaces
``P-h0`` ... with one veth pair each into the bridge; host k has ``10.77.0.(k+1)/24`` on its ``eth0``
(``--subnet`` changes the /24) and its loopback up. The namespaces reach each other and nothing else:
no interface of this machine's own namespace takes part, and no namespace has a route off the subnet.
``down --prefix P`` deletes them (the veth pairs go with them). Root only (``ip netns``).

    sudo python -m emulator.netns up --hosts 2 --prefix fleet
    sudo ip netns exec fleet-h0 flayer broker start --state-dir B --host 10.77.0.1 --port 0
    sudo ip netns exec fleet-h0 flayer emulate ... --shard 0/2 --broker-state B --out A &
    sudo ip netns exec fleet-h1 flayer emulate ... --shard 1/2 --broker-state B --out C
    sudo python -m emulator.netns down --prefix fleet

(docs/howto/emulate-across-hosts.md)
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

__all__ = ["NetnsError", "NetnsHosts", "main"]

PREFIX = re.compile(r"[a-z][a-z0-9]{0,7}")  # interface names are <= 15 characters: PREFIX-hNN fits


class NetnsError(RuntimeError):
    """The namespaces could not be made (not root, no ``ip``, a name taken)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise NetnsError("the 'ip' command (iproute2) is not installed") from None
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'status {done.returncode}'}")
    return done


@dataclass(frozen=True)
class NetnsHosts:
    prefix: str
    hosts: int
    subnet: str = "10.77.0.0/24"

    def __post_init__(self) -> None:
        if not PREFIX.fullmatch(self.prefix):
            raise NetnsError(f"prefix {self.prefix!r}: 1-8 lowercase letters and digits, starting with a letter")
        if not 1 <= self.hosts <= 99:
            raise NetnsError(f"hosts must be 1..99, got {self.hosts}")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise NetnsError(f"subnet {self.subnet!r}: {exc}") from None
        if not net.is_private or net.version != 4 or net.num_addresses < self.hosts + 2:
            raise NetnsError(f"subnet {self.subnet!r}: need a private IPv4 network with room for {self.hosts} hosts")

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def name(self, k: int) -> str:
        return f"{self.prefix}-h{k}"

    def address(self, k: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[k + 1])

    def exec_prefix(self, k: int) -> list[str]:
        """The command prefix that runs a command on host ``k``."""
        return ["ip", "netns", "exec", self.name(k)]

    def names(self) -> list[str]:
        return [self.switch, *(self.name(k) for k in range(self.hosts))]

    def up(self) -> NetnsHosts:
        existing = set(_ip("netns", "list").stdout.split())
        taken = [n for n in self.names() if n in existing]
        if taken:
            raise NetnsError(f"namespace(s) {', '.join(taken)} exist already: 'python -m emulator.netns down "
                             f"--prefix {self.prefix}' removes them")
        plen = ipaddress.ip_network(self.subnet).prefixlen
        try:
            _ip("netns", "add", self.switch)
            sw = ["-n", self.switch]
            _ip(*sw, "link", "add", "br0", "type", "bridge")
            _ip(*sw, "link", "set", "br0", "up")
            for k in range(self.hosts):
                ns = self.name(k)
                _ip("netns", "add", ns)
                # made inside the switch namespace, one end moved to the host: nothing in this machine's own
                _ip(*sw, "link", "add", f"h{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip(*sw, "link", "set", f"h{k}", "master", "br0")
                _ip(*sw, "link", "set", f"h{k}", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(k)}/{plen}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Delete this prefix's namespaces (every host's, however many); returns the ones deleted."""
        existing = set(_ip("netns", "list", check=False).stdout.split())
        host = re.compile(rf"{self.prefix}-h\d+")
        gone = []
        for n in sorted(existing, reverse=True):  # the hosts' first, then the switch
            if host.fullmatch(n) or n == self.switch:
                _ip("netns", "delete", n, check=False)
                gone.append(n)
        return gone

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    import os

    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "network namespaces need root"
    done = _ip("netns", "list", check=False)
    return None if done.returncode == 0 else f"ip netns: {done.stderr.strip()}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emulator.netns", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make the namespaces")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--subnet", default="10.77.0.0/24")
    down = sub.add_parser("down", help="delete the namespaces")
    for s in (up, down):
        s.add_argument("--prefix", default="fleet", help="namespace names: PREFIX-sw, PREFIX-h0, ...")
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            hosts = NetnsHosts(args.prefix, args.hosts, args.subnet).up()
            for k in range(hosts.hosts):
                print(f"{hosts.name(k)}\t{hosts.address(k)}\t{' '.join(hosts.exec_prefix(k))} COMMAND")
        else:
            gone = NetnsHosts(args.prefix, 1).down()
            print(f"deleted {', '.join(gone)}" if gone else f"no namespace of prefix {args.prefix!r}")
    except NetnsError as exc:
        print(f"python -m emulator.netns: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
