"""The simulated multi-host fabric (tests/harness/fabric.py): namespaces, shaping, cleanup on every exit path, and gloo across the fabric.

Needs root and iproute2 (`ip netns`, `tc`); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness.fabric import (
    PREFIX,
    Fabric,
    FabricError,
    _namespaces,
    cleanup_stale,
    unavailable_reason,
)

from distlm.runtime.dist import free_port

REASON = unavailable_reason()
# a child Python that imports the fabric finds it as the tests do (tests/ on its path)
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    ),
}
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(REASON is not None, reason=f"no netns fabric here: {REASON}"),
]


def _in(fab: Fabric, host: int, *argv: str) -> str:
    return subprocess.run(
        fab.command(host, list(argv)), capture_output=True, text=True, check=True, timeout=30
    ).stdout


def test_hosts_reach_each_other_over_shaped_links_and_vanish_on_exit():
    with Fabric(3, rate_mbit=200) as fab:
        names = fab.exists()
        assert sorted(names) == sorted([fab.switch] + [fab.ns(h) for h in range(3)])
        assert fab.address(0) in _in(fab, 0, "ip", "-4", "addr", "show", "dev", "eth0")
        # every host's link is shaped in both directions
        assert "rate 200Mbit" in _in(fab, 1, "tc", "qdisc", "show", "dev", "eth0")
        sw = subprocess.run(
            ["ip", "netns", "exec", fab.switch, "tc", "qdisc", "show", "dev", "p1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "rate 200Mbit" in sw
        # the machine's own namespace gains no fabric addresses
        assert (
            fab.address(0)
            not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        )
    assert fab.exists() == []


def test_namespaces_are_removed_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"), Fabric(2, rate_mbit=None) as fab:
        assert len(fab.exists()) == 3
        raise RuntimeError("boom")
    assert fab.exists() == []


def test_stale_namespaces_of_dead_processes_are_cleaned():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    name = f"{PREFIX}-{pid}-0-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in cleanup_stale()
        assert name not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_killed_owner_leaves_nothing_after_the_next_cleanup():
    code = (
        "from harness.fabric import Fabric; import os, sys\n"
        "f = Fabric(2, rate_mbit=None).__enter__(); print(f.tag, flush=True); os._exit(0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=CHILD_ENV
    ).stdout
    tag = out.strip()
    assert any(ns.startswith(tag) for ns in _namespaces())  # os._exit skips every hook...
    cleanup_stale()  # ...so the next user of the fabric removes them
    assert not any(ns.startswith(tag) for ns in _namespaces())


def test_a_probe_killed_halfway_leaves_nothing_after_the_next_cleanup():
    # the availability probe's process dies right after creating its namespace
    code = (
        "import os, harness.fabric as f\n"
        "real = f._run\n"
        "def run(cmd, what):\n"
        "    out = real(cmd, what)\n"
        "    if cmd[:3] == ['ip', 'netns', 'add']:\n"
        "        print(cmd[3], flush=True); os._exit(0)\n"
        "    return out\n"
        "f._run = run\n"
        "f.unavailable_reason()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=CHILD_ENV
    )
    probe = out.stdout.strip()
    assert probe.startswith(f"{PREFIX}-") and probe.endswith("-probe") and probe in _namespaces()
    assert probe in cleanup_stale()
    assert probe not in _namespaces()


def test_probes_of_the_earlier_naming_are_cleaned_too():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    name = f"{PREFIX}-probe-{int(dead.stdout)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in cleanup_stale()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def test_bad_arguments():
    with pytest.raises(FabricError, match="at least one host"):
        Fabric(0)
    with pytest.raises(FabricError, match="rate_mbit"):
        Fabric(2, rate_mbit=0)


WORKER = """
import json, os, torch
from distlm.runtime.dist import distributed
from distlm.settings import TransferSettings
from distlm.transfer import broadcast_state_dict
torch.set_num_threads(1)
with distributed(backend="gloo", timeout_s=60) as topo:
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(256, 257, generator=g) for i in range(6)}
    res = broadcast_state_dict(sd if topo.is_main else None, settings=TransferSettings(bucket_mb=0.25, chunk_mb=0.0625, timeout_s=30))
    ok = all(torch.equal(res.tensors[k], v) for k, v in sd.items())
    print(json.dumps({"rank": topo.rank, "ok": ok, "chain": res.stats.chain}))
"""


def test_broadcast_across_namespaces():
    with Fabric(3, rate_mbit=1000) as fab:
        port = free_port()
        procs = []
        for r in range(3):
            env = {
                **os.environ,
                **fab.env(r),
                "RANK": str(r),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": fab.address(0),
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            procs.append(
                subprocess.Popen(
                    fab.command(r, [sys.executable, "-c", WORKER]),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, (r, err[-3000:])
            rep = json.loads(out.strip().splitlines()[-1])
            assert rep == {"rank": r, "ok": True, "chain": [0, 1, 2]}
