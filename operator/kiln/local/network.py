"""The local cluster's pod network: a Linux bridge and network namespaces on veth pairs.

Kubernetes rejects loopback addresses in Endpoints and EndpointSlices, so pods need real
addresses. The bridge holds the gateway (first address of the subnet); each pod that the
test runtime runs gets a namespace whose eth0 holds the pod's IP. Nothing is forwarded or
NATed: traffic stays between the host and these namespaces.

Every namespace made here is recorded as a file under <state>/netns/, so `down` removes
exactly those and nothing else on the machine.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# ss states of a socket whose FIN is not yet acknowledged (established ones count by Send-Q)
UNDELIVERED_STATES = ("FIN-WAIT-1", "CLOSING", "LAST-ACK")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return ip("link", "show", "dev", name, check=False).returncode == 0


@dataclass(frozen=True)
class PodNetwork:
    bridge: str  # at most 9 characters: namespace names and veths derive from it
    subnet: ipaddress.IPv4Network
    state_dir: Path

    @property
    def gateway(self) -> str:
        return str(self.subnet[1])

    def node_cidrs(self, count: int) -> list[str]:
        """Pod CIDRs for `count` nodes: quarters of the subnet, skipping the one with the gateway."""
        blocks = list(self.subnet.subnets(prefixlen_diff=2))[1:]
        if count > len(blocks):
            raise ValueError(f"{self.subnet} has room for {len(blocks)} nodes, not {count}")
        return [str(b) for b in blocks[:count]]

    def check_free(self) -> None:
        """Refuse a bridge name that exists or a subnet the host already routes."""
        if link_exists(self.bridge):
            raise RuntimeError(f"network device {self.bridge} already exists; pick another with --bridge "
                               f"or remove it (`ip link del {self.bridge}`) if it is left over")
        # JSON: the text form's lines may start with a route type (blackhole, unreachable) or a nexthop.
        for route in json.loads(ip("-j", "-4", "route", "show").stdout or "[]"):
            try:
                dest = ipaddress.IPv4Network(route.get("dst", ""), strict=False)
            except ValueError:  # "default", or no destination at all
                continue
            if self.subnet.overlaps(dest):
                raise RuntimeError(f"{self.subnet} overlaps the host route to {route['dst']}; pick another --subnet")

    def create_bridge(self) -> None:
        ip("link", "add", "name", self.bridge, "type", "bridge")
        try:
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except BaseException:  # a half-made bridge is ours to remove: the caller records only a whole one
            self.delete_bridge()
            raise

    def delete_bridge(self) -> None:
        if link_exists(self.bridge):
            ip("link", "del", self.bridge)

    def netns_name(self, name: str) -> str:
        return f"{self.bridge}-{name}"

    def records(self) -> Path:
        return self.state_dir / "netns"

    def namespaces(self) -> list[str]:
        """Names (as passed to create_namespace) of the namespaces this network made."""
        return sorted(p.name for p in self.records().glob("*")) if self.records().is_dir() else []

    def create_namespace(self, name: str, address: str) -> str:
        """Make namespace `name` with eth0 = `address` on the bridge; returns the netns name.

        Run a process inside it with `ip netns exec <netns name> ...` (see exec_prefix).
        """
        addr = ipaddress.IPv4Address(address)
        if addr not in self.subnet or str(addr) == self.gateway:
            raise ValueError(f"{address} is not a pod address in {self.subnet} (gateway {self.gateway})")
        netns = self.netns_name(name)
        if len(netns) > 64 or "/" in name:
            raise ValueError(f"namespace name {name!r} is too long or has a '/'")
        # One of this name is this cluster's (its bridge's name is in it), left by a runtime that
        # crashed or a create that failed half way: its pod is started anew, so it goes.
        self.delete_namespace(name)
        # Recorded before it is made, so that `down` also cleans up a half-made one.
        self.records().mkdir(parents=True, exist_ok=True)
        (self.records() / name).write_text(f"{netns} {address}\n")
        host, peer = self.veth_names(name)
        ip("netns", "add", netns)
        ip("link", "add", host, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", netns)
        ip("-n", netns, "link", "set", peer, "name", "eth0")
        ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "route", "add", "default", "via", self.gateway)
        ip("link", "set", host, "master", self.bridge, "up")
        # Pod addresses are reused: whoever talked to this address's previous pod still has its
        # MAC cached and would send there (connects hang for seconds) until the entry expires.
        # Real CNI plugins send a gratuitous ARP; flushing the entries is the sure way here.
        for other in self.namespaces():
            if other != name:
                ip("-n", self.netns_name(other), "neigh", "flush", "to", address, check=False)
        ip("neigh", "flush", "to", address, "dev", self.bridge, check=False)
        return netns

    def veth_names(self, name: str) -> tuple[str, str]:
        # veth names are limited to 15 characters, so they carry a digest of the name
        digest = hashlib.sha1(self.netns_name(name).encode()).hexdigest()[:10]
        return f"vh{digest}", f"vp{digest}"

    def wait_delivered(self, name: str, timeout: float = 3.0) -> bool:
        """Wait until no TCP socket in the namespace holds data or a FIN its peer has not
        acknowledged. A pod that exits right after its last write leaves those bytes to the kernel;
        cutting the veth at once dropped them, and a stream the pod had finished arrived cut short.
        (A kubelet's sandbox teardown takes long enough not to race it.) False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run([*self.exec_prefix(name), "ss", "-Htn"], capture_output=True, text=True).stdout
            pending = [line for line in out.splitlines()
                       if line.split()[0] in UNDELIVERED_STATES or line.split()[2] != "0"]  # Send-Q
            if not pending or time.monotonic() >= deadline:
                return not pending
            time.sleep(0.05)

    def delete_namespace(self, name: str) -> None:
        """Remove a namespace made by create_namespace, with its veth pair and what runs in it."""
        netns, (host, _) = self.netns_name(name), self.veth_names(name)
        if link_exists(host):
            ip("link", "del", host)
        if netns in self.system_namespaces():
            # `ip netns del` only unmounts it: processes inside (a crashed runtime's pods) run on.
            for pid in ip("netns", "pids", netns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "del", netns)
        (self.records() / name).unlink(missing_ok=True)

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns_name(name)]

    @staticmethod
    def system_namespaces() -> set[str]:
        out = ip("netns", "list").stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}
