"""`kiln local up/down/status`: a real control plane as local processes.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok listen on
127.0.0.1 (free ports picked at `up`); pods get addresses on the cluster's own bridge.
Everything `up` makes is recorded in <dir>/state.json as it is made, so `down` — even
after a failed `up` — stops exactly those processes and removes exactly those things.
"""
from __future__ import annotations

import fcntl
import hashlib
import http.client
import ipaddress
import json
import os
import shutil
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TextIO

from kiln.local import build, kwok, pki, processes
from kiln.local.network import PodNetwork

# Overridable so that a second cluster (another checkout, a CI job) can run beside the first.
DEFAULT_BRIDGE = os.environ.get("KILN_LOCAL_BRIDGE", "kiln0")
DEFAULT_SUBNET = os.environ.get("KILN_LOCAL_SUBNET", "10.213.0.0/24")
SERVICE_CIDR = "10.96.0.0/16"
NODES = ("kiln-gpu-0", "kiln-gpu-1")
# Top-level entries of the state directory that `up` creates and `down` removes.
ENTRIES = ("state.json", "pki", "etcd", "logs", "certs", "admin.kubeconfig", "controller-manager.kubeconfig",
           "scheduler.kubeconfig", "kwok.yaml", "netns", "users", "pods", "runtime.lock")
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
RUNTIME = "runtime"  # the test pod runtime (kiln.local.runtime), started after the control plane
# ServiceAccount tokens of pods and of `make up`'s operator are minted once, never refreshed: a
# year, or a cluster up for longer than a day gets 401s forever. The apiserver (commands()) sets
# no --service-account-max-token-expiration, so it grants the whole request.
TOKEN_SECONDS = 365 * 24 * 3600


def default_dir() -> Path:
    return Path(os.environ.get("KILN_LOCAL_DIR") or build.cache_root() / "local")


def check_network(bridge: str, subnet: str) -> str | None:
    """The reason the bridge name or subnet cannot be used, or None."""
    if not bridge.isalnum() or not 1 <= len(bridge) <= 9:
        return f"--bridge {bridge!r}: use 1-9 letters/digits (namespaces and veths derive names from it)"
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as exc:
        return f"--subnet {subnet!r}: {exc}"
    if not 16 <= net.prefixlen <= 28 or not net.is_private or net.overlaps(ipaddress.IPv4Network("127.0.0.0/8")):
        return f"--subnet {subnet}: use a private, non-loopback IPv4 range from /16 to /28"
    return None


@dataclass
class Cluster:
    dir: Path

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def state(self) -> dict:
        """What `up` recorded; a state file that is not what it wrote (cut short, edited) says so
        in one line (kiln local's RuntimeError), naming it."""
        if not self.state_file.exists():
            return {}
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError) as err:
            raise RuntimeError(f"{self.state_file}: unreadable ({err}); stop its processes by hand and remove "
                               f"{self.dir}") from None
        records = state.get("processes") if isinstance(state, dict) else None
        if (not isinstance(records, dict) or not {"bridge", "subnet", "ports"} <= state.keys()
                or not all(isinstance(r, dict) and {"pid", "start"} <= r.keys() for r in records.values())):
            raise RuntimeError(f"{self.state_file}: not a state `kiln local up` wrote; stop its processes "
                               f"by hand and remove {self.dir}")
        return state

    def save(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.rename(self.state_file)

    def network(self, state: dict | None = None) -> PodNetwork:
        state = self.state() if state is None else state
        return PodNetwork(state["bridge"], ipaddress.IPv4Network(state["subnet"]), self.dir)

    def running(self) -> dict[str, bool]:
        """Each recorded process and whether it still runs."""
        return {name: processes.alive(rec) for name, rec in self.state().get("processes", {}).items()}

    def is_up(self) -> bool:
        running = self.running()
        return all(running.get(name) for name in ORDER)

    def other_network(self, bridge: str | None, subnet: str | None) -> str | None:
        """Why a cluster already up does not take this bridge or subnet (it keeps its own); None if
        it is not up or they are its own."""
        if not self.is_up():
            return None
        state = self.state()
        for flag, asked, own in (("--bridge", bridge, state["bridge"]), ("--subnet", subnet, state["subnet"])):
            if asked is not None and asked != own:
                return f"the cluster in {self.dir} is up with {flag} {own}: `kiln local down` first to use {asked}"
        return None

    def users(self) -> list[int]:
        """Pids of the test sessions still using the cluster."""
        pids = []
        for path in self.dir.glob("users/*"):
            try:
                record = {"pid": int(path.name), "start": int(path.read_text())}
            except (OSError, ValueError):  # add_user's temp file, or a garbled entry: no session
                continue
            if processes.alive(record):
                pids.append(record["pid"])
        return pids

    def add_user(self, user: int) -> None:
        users = self.dir / "users"
        users.mkdir(exist_ok=True)
        # Whole or absent: a session killed mid-write must not leave an entry users() cannot read.
        tmp = users / f"{user}.tmp"
        tmp.write_text(str(processes.start_ticks(user)))
        os.replace(tmp, users / str(user))

    @contextmanager
    def locked(self) -> Iterator[None]:
        # Serialises up/down between processes (two pytest sessions, a user's shell).
        # The lock lives in Kiln's cache, not beside or in the directory that `down` removes.
        self.dir.mkdir(parents=True, exist_ok=True)
        locks = build.cache_root() / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha1(str(self.dir.resolve()).encode()).hexdigest()[:16]
        with open(locks / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def server(self) -> str:
        return f"https://127.0.0.1:{self.state()['ports']['apiserver']}"

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        """One request to the apiserver as cluster admin."""
        ctx = ssl.create_default_context(cafile=str(self.dir / "pki" / "ca.crt"))
        ctx.load_cert_chain(self.dir / "pki" / "admin.crt", self.dir / "pki" / "admin.key")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server() + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urlopen(req, timeout=10, context=ctx) as resp:
            raw = resp.read()
        return json.loads(raw) if raw.startswith(b"{") else {"body": raw.decode()}


def urlopen(url: str | urllib.request.Request, timeout: float,
            context: ssl.SSLContext | None = None) -> http.client.HTTPResponse:
    """urllib's urlopen, never through a proxy: what kiln local reaches (loopback, the pods'
    bridge) is on this machine, and a user's http_proxy/https_proxy would send it elsewhere."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers).open(url, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], object], timeout: float, record: dict | None = None) -> None:
    """Poll check() until it is truthy; fail early with the log if the process died."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if record is not None and not processes.alive(record):
            processes.reap(record["pid"])  # no zombie left in a caller that lives on (a test session)
            raise RuntimeError(f"{what}: process exited\n{processes.log_tail(record)}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ssl.SSLError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    tail = processes.log_tail(record) if record else ""
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s (last error: {last})\n{tail}")


def https_ok(url: str) -> bool:
    # The controller-manager and scheduler serve /healthz with self-signed certificates.
    ctx = ssl._create_unverified_context()
    with urlopen(url, timeout=5, context=ctx) as resp:
        return resp.status == 200


def commands(c: Cluster, state: dict) -> dict[str, list[str]]:
    """The command line of each component, from the ports and paths in `state`."""
    d, p, pk = c.dir, state["ports"], c.dir / "pki"
    net = c.network(state)
    peer = f"http://127.0.0.1:{p['etcd_peer']}"
    return {
        "etcd": [str(build.binary("etcd")), "--name=kiln", f"--data-dir={d / 'etcd'}",
                 f"--listen-client-urls=http://127.0.0.1:{p['etcd']}",
                 f"--advertise-client-urls=http://127.0.0.1:{p['etcd']}",
                 f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                 f"--initial-cluster=kiln={peer}", "--unsafe-no-fsync", "--log-level=warn"],
        "kube-apiserver": [
            str(build.binary("kube-apiserver")), "--bind-address=127.0.0.1", f"--secure-port={p['apiserver']}",
            # Endpoints may not hold loopback addresses, so the apiserver advertises the bridge gateway.
            f"--advertise-address={net.gateway}", f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            f"--client-ca-file={pk / 'ca.crt'}", f"--tls-cert-file={pk / 'apiserver.crt'}",
            f"--tls-private-key-file={pk / 'apiserver.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pk / 'sa.pub'}", f"--service-account-signing-key-file={pk / 'sa.key'}",
            f"--requestheader-client-ca-file={pk / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client", "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pk / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pk / 'front-proxy-client.key'}",
            "--enable-admission-plugins=NodeRestriction", "--profiling=false"],
        "kube-controller-manager": [
            str(build.binary("kube-controller-manager")), *client_flags(c, "controller-manager"),
            "--bind-address=127.0.0.1", f"--secure-port={p['controller_manager']}", f"--cert-dir={d / 'certs'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pk / 'sa.key'}", f"--root-ca-file={pk / 'ca.crt'}",
            f"--cluster-signing-cert-file={pk / 'ca.crt'}", f"--cluster-signing-key-file={pk / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--cluster-name=kiln-local", "--profiling=false"],
        "kube-scheduler": [
            str(build.binary("kube-scheduler")), *client_flags(c, "scheduler"), "--bind-address=127.0.0.1",
            f"--secure-port={p['scheduler']}", f"--cert-dir={d / 'certs'}", "--leader-elect=false",
            "--profiling=false"],
        "kwok": [str(build.binary("kwok")), f"--kubeconfig={c.kubeconfig}", f"--config={d / 'kwok.yaml'}",
                 f"--manage-nodes-with-annotation-selector={kwok.NODE_ANNOTATION}=true",
                 f"--node-ip={net.gateway}", f"--server-address=127.0.0.1:{p['kwok']}",
                 # Lease heartbeats; without them the node controller marks the nodes NotReady
                 # (and taints them) 40 s after they came up.
                 "--node-lease-duration-seconds=40",
                 f"--cidr={net.node_cidrs(len(NODES) + 1)[-1]}"],
    }


def client_flags(c: Cluster, client: str) -> list[str]:
    config = c.dir / f"{client}.kubeconfig"
    return [f"--kubeconfig={config}", f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}"]


def health_checks(c: Cluster, state: dict) -> dict[str, Callable[[], bool]]:
    p = state["ports"]
    return {
        "etcd": lambda: urlopen(f"http://127.0.0.1:{p['etcd']}/health", timeout=5).status == 200,
        "kube-apiserver": lambda: c.api("GET", "/readyz")["body"] == "ok",
        "kube-controller-manager": lambda: https_ok(f"https://127.0.0.1:{p['controller_manager']}/healthz"),
        "kube-scheduler": lambda: https_ok(f"https://127.0.0.1:{p['scheduler']}/healthz"),
        "kwok": lambda: urlopen(f"http://127.0.0.1:{p['kwok']}/healthz", timeout=5).status == 200,
    }


def up(directory: Path, bridge: str = DEFAULT_BRIDGE, subnet: str = DEFAULT_SUBNET,
       log: TextIO = sys.stderr, timeout: float = 180.0, user: int | None = None,
       jobs: int = 2) -> tuple[Cluster, bool]:
    """Start the cluster unless it runs already; returns (cluster, whether this call started it).

    `user` (a pid) registers a test session: a cluster that sessions started is taken down
    by the last of them to leave(), never under another session that still uses it. An `up`
    without one (a user's) makes the cluster the user's: no session takes it down then.
    `jobs`: parallel Go compile jobs if the binaries need building.
    """
    # Here, not only in the CLI: `make up` and tests take bridge and subnet from the environment.
    problem = check_network(bridge, subnet)
    if problem:
        raise RuntimeError(problem)
    c = Cluster(directory)
    dir_created = not c.dir.exists() or c.state().get("dir_created", False)
    with c.locked():
        started = not c.is_up()
        if started:
            if c.state():  # left over from a crash or a partial up: clean it before starting over
                print(f"cleaning up a stale local cluster in {c.dir}", file=log)
                teardown(c)
            # Before the try: the clean-up of a failed start removes these entries, a user's too.
            leftovers = [e for e in ENTRIES if (c.dir / e).exists()]
            if leftovers:
                raise RuntimeError(f"{c.dir} holds {leftovers} from something else; use an empty directory")
            build.ensure_built(jobs=jobs, log=log)
            try:
                start(c, bridge, ipaddress.IPv4Network(subnet), dir_created, log, timeout)
                # In the try: a cluster started here but left without its runtime would be owned
                # by no one (not marked for the tests below), so nothing would ever take it down.
                ensure_runtime(c, log)
            except BaseException:
                remove(c)
                raise
        else:
            ensure_runtime(c, log)
        if user is not None:
            c.add_user(user)
            if started:
                c.save({**c.state(), "owner": "tests"})
        elif c.state().get("owner") == "tests":
            c.save({k: v for k, v in c.state().items() if k != "owner"})
        return c, started


def leave(c: Cluster, user: int) -> bool:
    """Unregister a test session; the last one out takes a test-started cluster down."""
    with c.locked():
        (c.dir / "users" / str(user)).unlink(missing_ok=True)
        if c.users() or c.state().get("owner") != "tests":
            return False
        remove(c)
    return True


def start(c: Cluster, bridge: str, subnet: ipaddress.IPv4Network, dir_created: bool, log: TextIO,
          timeout: float) -> None:
    ports = {k: free_port() for k in ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok")}
    state = {"bridge": bridge, "subnet": str(subnet), "ports": ports, "processes": {}, "bridge_created": False,
             "dir_created": dir_created}
    c.save(state)
    net = c.network(state)
    net.check_free()
    net.create_bridge()
    # Only once made: a failed add may have met a bridge of that name that another cluster made
    # since check_free(), and `down` must not delete that one. (create_bridge removes a half-made one.)
    state["bridge_created"] = True
    c.save(state)
    started = time.monotonic()
    pki.make_pki(c.dir / "pki", ["127.0.0.1", net.gateway, str(ipaddress.IPv4Network(SERVICE_CIDR)[1])])
    for client in ("admin", "controller-manager", "scheduler"):
        pki.write_kubeconfig(c.dir / f"{client}.kubeconfig", c.dir / "pki", client, c.server())
    (c.dir / "kwok.yaml").write_text(kwok.stages_yaml())
    checks, argv = health_checks(c, state), commands(c, state)
    for name in ORDER:
        if name == "kwok":
            create_nodes(c, net)
        record = processes.launch(argv[name], c.dir / "logs" / f"{name}.log")
        state["processes"][name] = record
        c.save(state)
        wait_for(name, checks[name], timeout, record)
        print(f"{name} ready (pid {record['pid']})", file=log, flush=True)
    wait_for("nodes Ready", lambda: nodes_ready(c), timeout, state["processes"]["kwok"])
    # Pods are refused until the controller-manager has made the default ServiceAccount.
    wait_for("default ServiceAccount", lambda: c.api("GET", "/api/v1/namespaces/default/serviceaccounts/default"),
             timeout, state["processes"]["kube-controller-manager"])
    print(f"local cluster up in {time.monotonic() - started:.0f}s: {c.server()} kubeconfig={c.kubeconfig}",
          file=log, flush=True)


def ensure_runtime(c: Cluster, log: TextIO) -> None:
    """Start the test pod runtime unless it runs (a cluster from before it existed gets one too)."""
    state = c.state()
    if c.running().get(RUNTIME):
        return
    argv = [sys.executable, "-m", "kiln.cli", "local", "runtime", f"--dir={c.dir}"]
    log_path = c.dir / "logs" / f"{RUNTIME}.log"
    # The log is appended to across restarts: only what this launch writes tells that it is up.
    offset = log_path.stat().st_size if log_path.exists() else 0
    record = processes.launch(argv, log_path)
    state["processes"][RUNTIME] = record
    c.save(state)
    wait_for(RUNTIME, lambda: "pod runtime up" in read_from(log_path, offset), 60, record)
    print(f"{RUNTIME} ready (pid {record['pid']})", file=log, flush=True)


def read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def create_nodes(c: Cluster, net: PodNetwork) -> None:
    for name, cidr in zip(NODES, net.node_cidrs(len(NODES))):
        c.api("POST", "/api/v1/nodes", kwok.node_manifest(name, cidr))


def nodes_ready(c: Cluster) -> bool:
    items = c.api("GET", "/api/v1/nodes")["items"]
    ready = {n["metadata"]["name"] for n in items
             if any(x["type"] == "Ready" and x["status"] == "True" for x in n["status"].get("conditions", []))}
    return set(NODES) <= ready


def teardown(c: Cluster) -> None:
    """Stop the recorded processes and remove the recorded network and files."""
    state = c.state()
    # Last started, first stopped: the operator (kiln.local.demo), the runtime (it stops the
    # pods' processes), then the control plane.
    for record in reversed(list(state.get("processes", {}).values())):
        processes.stop(record)
    # Containers of container-mode pods outlive a runtime that was killed rather than stopped.
    from kiln.local import containers, images  # podman's, not needed before
    images.remove_containers(f"{containers.CLUSTER_LABEL}={c.dir}")
    if "bridge" in state:
        net = c.network(state)
        for name in net.namespaces():
            net.delete_namespace(name)
        if state.get("bridge_created"):
            net.delete_bridge()
    for entry in ENTRIES:
        path = c.dir / entry
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def remove(c: Cluster) -> None:
    """teardown(), then drop the directory if `up` made it; call with the lock held."""
    state = c.state()
    teardown(c)
    if state.get("dir_created") and not any(c.dir.iterdir()):
        c.dir.rmdir()


def down(directory: Path, force: bool = False) -> bool:
    """Take the cluster in `directory` down; returns False if there was none."""
    c = Cluster(directory)
    if not c.dir.exists():
        return False
    with c.locked():
        if not c.state():  # nothing `up` made, or another project's directory: remove nothing
            return False
        if c.users() and not force:
            raise RuntimeError(f"test sessions (pids {c.users()}) still use the cluster; wait, or force it: "
                               "`kiln local down --force`, `make down FORCE=1`")
        remove(c)
    return True
