"""A simulated multi-host fabric on one machine: one network namespace per host, rate-shaped links.

    with Fabric(hosts=4, rate_mbit=1000) as fab:           # needs root and iproute2 (ip, tc)
        subprocess.run(fab.command(0, ["python", "worker.py"]), env={**os.environ, **fab.env(0)})

Layout: a switch namespace holds a bridge; every host namespace holds one veth (`eth0`, address
fab.address(i)) whose peer is a bridge port. Both ends of every veth are shaped with a token bucket
(`tc qdisc ... tbf`) to `rate_mbit`, so each host sends and receives at most the link rate, as a
host with one NIC does. The link rate, not the CPU, is then the bottleneck, and a broadcast that
sends the model over the source's link N times is measured as such. Only addresses inside these
namespaces are used; nothing is added to the machine's own network namespace.

Every exit path removes the namespaces (deleting a namespace deletes its veths): `__exit__`, an
atexit hook for an interpreter that exits without leaving the `with` block, and `cleanup_stale`
for namespaces left by a process that was killed (their names carry its pid, the availability
probe's `dlmfab-PID-probe` too; the probe and every fabric run it first).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from functools import lru_cache
from typing import Self

from distlm import DistlmError
from distlm.core.io import pid_alive
from distlm.core.log import get_logger

log = get_logger(__name__)

PREFIX = "dlmfab"
IFNAME = "eth0"


class FabricError(DistlmError):
    """The fabric cannot be built here; the message says which requirement is missing."""


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise FabricError(
            f"{what} failed: `{' '.join(cmd)}` -> {proc.stderr.strip() or proc.returncode}"
        )
    return proc.stdout


@lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why a fabric cannot be built here (None: it can): root, iproute2, tc, netns support."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    cleanup_stale()  # a probe or a fabric of a killed process
    # The probe's name carries this pid like a fabric's, so cleanup_stale removes it if this
    # process is killed before the `finally` below runs.
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        try:
            _run(["ip", "netns", "add", probe], "creating a network namespace")
            _run(
                [
                    "ip",
                    "-n",
                    probe,
                    "link",
                    "add",
                    "name",
                    "pa",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "pb",
                ],
                "creating a veth pair",
            )
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    probe,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "pa",
                    "root",
                    "tbf",
                    "rate",
                    "100mbit",
                    "burst",
                    "64kb",
                    "latency",
                    "50ms",
                ],
                "shaping a veth with tc tbf",
            )
        finally:
            # also when `add` timed out or failed halfway: deleting an absent namespace is harmless
            subprocess.run(
                ["ip", "netns", "del", probe], check=False, capture_output=True, timeout=30
            )
    except (FabricError, OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` is unavailable: {e}"
    return None


def _namespaces() -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Delete fabric namespaces whose creating process is gone; returns their names."""
    removed = []
    for ns in _namespaces():
        parts = ns.split("-")
        # dlmfab-PID-...; dlmfab-probe-PID is the probe's name before the pid came first
        pid = parts[1] if len(parts) >= 3 and parts[1] != "probe" else parts[-1]
        if len(parts) >= 3 and parts[0] == PREFIX and pid.isdigit() and not pid_alive(int(pid)):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
            removed.append(ns)
    if removed:
        log.info("removed %d stale fabric namespaces: %s", len(removed), ", ".join(removed))
    return removed


_COUNTER = iter(range(1 << 30))


class Fabric:
    """`hosts` network namespaces on a shaped bridge; see the module docstring."""

    def __init__(
        self, hosts: int, *, rate_mbit: float | None = 1000.0, latency_ms: float = 50.0
    ) -> None:
        if hosts < 1:
            raise FabricError(f"a fabric needs at least one host, got {hosts}")
        if hosts > 250:
            raise FabricError(f"at most 250 hosts per fabric (one /24), got {hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise FabricError(f"rate_mbit must be positive, got {rate_mbit}")
        self.hosts, self.rate_mbit, self.latency_ms = hosts, rate_mbit, latency_ms
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}"
        self.switch = f"{self.tag}-sw"
        self.created: list[str] = []

    def ns(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def address(self, host: int) -> str:
        return f"10.213.57.{host + 1}"  # private to the fabric's namespaces: fabrics never collide

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run inside host's namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def env(self, host: int) -> dict[str, str]:
        """Environment for a torch.distributed process on `host` (gloo on the fabric's link)."""
        return {
            "GLOO_SOCKET_IFNAME": IFNAME,
            "TP_SOCKET_IFNAME": IFNAME,
            "NCCL_SOCKET_IFNAME": IFNAME,
        }

    def __enter__(self) -> Self:
        reason = unavailable_reason()
        if reason:
            raise FabricError(f"cannot build the fabric: {reason}")
        cleanup_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name], f"creating namespace {name}")
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"], f"bringing up lo in {name}")

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit is None:
            return
        # burst: at least 1 ms of traffic at the link rate, and at least 64 KB so GSO frames pass.
        burst_kb = max(64, int(self.rate_mbit * 1000 / 8 / 1000))
        _run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{self.rate_mbit}mbit",
                "burst",
                f"{burst_kb}kb",
                "latency",
                f"{self.latency_ms}ms",
            ],
            f"shaping {dev} in {ns}",
        )

    def _build(self) -> None:
        self._add_ns(self.switch)
        _run(
            ["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"], "creating the bridge"
        )
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"], "bringing up the bridge")
        for h in range(self.hosts):
            ns, port = self.ns(h), f"p{h}"
            self._add_ns(ns)
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    "name",
                    IFNAME,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.switch,
                ],
                f"creating the veth of host {h}",
            )
            _run(
                ["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"],
                f"plugging host {h} in",
            )
            _run(
                ["ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", IFNAME],
                f"addressing host {h}",
            )
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"], f"bringing up host {h}")
            self._shape(ns, IFNAME)  # what the host sends
            self._shape(self.switch, port)  # what the host receives
        log.info(
            "fabric %s: %d hosts on %s/24, links %s",
            self.tag,
            self.hosts,
            self.address(0),
            f"{self.rate_mbit} Mbit/s" if self.rate_mbit else "unshaped",
        )

    def close(self) -> None:
        """Delete every namespace this fabric created (idempotent)."""
        while self.created:
            ns = self.created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        atexit.unregister(self.close)

    def exists(self) -> list[str]:
        """This fabric's namespaces that exist now (empty once closed)."""
        return [ns for ns in _namespaces() if ns.startswith(self.tag + "-")]
