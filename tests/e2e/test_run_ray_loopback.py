"""The local Ray cluster that ``miles-lp run`` starts listens on loopback only (the project's rule:
servers bind 127.0.0.1 by default). Measured, not assumed: every listening TCP socket and every bound UDP socket of
the cluster's processes (the driver, its descendants: GCS, raylet, workers, agents; and any process naming the
session folder), with an actor started so that a core worker listens too. The same measurement on a plain
``ray.init`` (in a subprocess) finds sockets on every interface: it can fail."""

from __future__ import annotations

import inspect
import ipaddress
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # each starts a Ray cluster (~10 s on 2 cores)


# the measurement: run in this process, and in a subprocess as source (inspect.getsource), the very same code
def listening_sockets():
    """(process, ip, port, kind) of every listening TCP / bound unconnected UDP socket of this Ray session."""
    import psutil
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    me = psutil.Process()
    procs = {p.pid: p for p in [me, *me.children(recursive=True)]}
    for p in psutil.process_iter(["cmdline"]):
        if session in " ".join(p.info["cmdline"] or []):
            procs.setdefault(p.pid, p)
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid not in procs or not c.laddr:
            continue
        tcp_listen = c.type == 1 and c.status == psutil.CONN_LISTEN
        udp_bound = c.type == 2 and not c.raddr
        if tcp_listen or udp_bound:
            try:
                name = procs[c.pid].name()
            except psutil.Error:
                name = str(c.pid)
            out.append((name, c.laddr.ip, c.laddr.port, "tcp" if tcp_listen else "udp"))
    return out


def start_actor():
    import os

    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self):
            return os.getpid()
    a = Probe.remote()
    ray.get(a.pid.remote())
    return a


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1: an IPv6 socket bound to the IPv4 loopback
    return (mapped or addr).is_loopback


def test_the_launchers_local_cluster_listens_on_loopback_only():
    import ray
    from ray._private import ray_constants

    from miles_lp.launch import ray_launcher
    from miles_lp.launch.recipe import load_recipe_text

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already up in this process")
    switch, env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(ray_launcher.MULTI_NODE_VAR)
    recipe = load_recipe_text("model: {path: 'tiny:qwen3'}\nprecision: {default: mxfp8}\nsteps: 1\n"
                              "ray: {enabled: true, num_cpus: 1}\n")
    assert ray_launcher._init_ray(recipe) is True  # started here, as run_with_ray starts it
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
        start_actor()
        socks = listening_sockets()
    finally:
        ray.shutdown()
    names = {n for n, *_ in socks}
    assert len(socks) >= 4 and "gcs_server" in names and "raylet" in names, socks  # the servers were seen
    exposed = [s for s in socks if not _loopback(s[1])]
    assert exposed == [], exposed
    print("listening:", sorted(socks))
    # the switch is Ray's for this start only: restored in this process and its environment
    assert ray_constants.ENABLE_RAY_CLUSTER == switch and os.environ.get(ray_launcher.MULTI_NODE_VAR) == env


def test_a_plain_ray_init_listens_on_every_interface():
    """The measurement can fail: Ray's default (the launcher's call before this fix) binds the outward address."""
    import socket

    try:  # an outward interface to be exposed on (Ray takes loopback anyway on a host without one)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a route
            outward = s.getsockname()[0]
    except OSError:
        outward = "127.0.0.1"
    if _loopback(outward):
        pytest.skip("this host has no outward interface")
    code = inspect.getsource(listening_sockets) + inspect.getsource(start_actor) + textwrap.dedent('''
        import json
        import ray
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            start_actor()
            print("SOCKETS", json.dumps(listening_sockets()))
        finally:
            ray.shutdown()
    ''')
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    socks = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("SOCKETS "))[len("SOCKETS "):])
    exposed = [s for s in socks if not _loopback(s[1])]
    assert any(n == "gcs_server" for n, *_ in exposed), socks  # the GCS on :: or the outward address
