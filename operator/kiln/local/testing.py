"""Helpers for whatever drives a cluster from outside: tests/, e2e/ and `make up` (kiln.local.demo).

- eventually(check, what, ...): poll until check() is truthy, or fail saying what was last seen.
- kubectl(kubeconfig, *args, ...): run kubectl (by default the one the local cluster builds).
- service_account_kubeconfig(admin, namespace, account, path, ...): a kubeconfig holding only a
  ServiceAccount's token (TokenRequest), to run something with exactly the RBAC it is granted.
- api_client(kubeconfig): a kubernetes ApiClient for any kubeconfig (admin's or a token one).
- OperatorProcess(kubeconfig, log, args): `kiln operator` as a process to start, stop, kill and restart.
- reconcile_passes(port, namespace, name): the passes an operator serving /metrics on `port` began.
- loopback_hosts(): "127.0.0.1", and "[::1]" where this machine has IPv6, as URL hosts.
"""
from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import kubernetes
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kiln.local import build
from kiln.local.pki import write_private

T = TypeVar("T")


def eventually(check: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.5,
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll check() until it returns something truthy, and return that.

    An exception of a type in `ignore` counts as "not yet"; any other propagates at once.
    After `timeout` seconds (check() runs at least once), raise AssertionError naming `what`
    and the last value or exception seen."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except ignore as exc:
            last: object = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


class KubectlError(RuntimeError):
    """kubectl exited non-zero; the message ends with kubectl's own error output."""


def kubectl(kubeconfig: Path | str, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 120, binary: Path | str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `kubectl --kubeconfig=<kubeconfig> <args>`, text in and out.

    binary: None for the kubectl that the local cluster builds (kiln.local.build), else a path
    or a name on PATH. With check, a non-zero exit raises KubectlError; running past `timeout`
    seconds raises subprocess.TimeoutExpired."""
    exe = str(build.binary("kubectl") if binary is None else binary)
    done = subprocess.run([exe, f"--kubeconfig={kubeconfig}", *args], input=input, capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise KubectlError(f"kubectl {' '.join(args)} (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


def service_account_kubeconfig(admin: kubernetes.client.ApiClient, namespace: str, account: str, path: Path,
                               expiration_s: int = 3600, server: str | None = None,
                               bound_to: dict | None = None) -> Path:
    """Write (mode 0600) and return a kubeconfig with only a token of ServiceAccount namespace/account.

    The token comes from a TokenRequest made with `admin` (the ServiceAccount must exist).
    The cluster entry is admin's server (or `server`: another address of the same apiserver)
    and admin's CA, inlined so the file stands alone. bound_to: a TokenRequest boundObjectRef
    ({"kind": "Pod", "apiVersion": "v1", "name": ..., "uid": ...}): the token dies with that object."""
    spec: dict = {"expirationSeconds": expiration_s}
    if bound_to is not None:
        spec["boundObjectRef"] = bound_to
    core = kubernetes.client.CoreV1Api(admin)
    token = core.create_namespaced_service_account_token(account, namespace, {"spec": spec}).status.token
    cluster = {"server": server or admin.configuration.host}
    if admin.configuration.ssl_ca_cert:
        cluster["certificate-authority-data"] = base64.b64encode(
            Path(admin.configuration.ssl_ca_cert).read_bytes()).decode()
    user = f"system:serviceaccount:{namespace}:{account}"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "cluster", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "cluster", "user": user}}]}))
    return path


def api_client(kubeconfig: Path | str) -> kubernetes.client.ApiClient:
    """A kubernetes ApiClient authenticated as the kubeconfig's current context; close it when done."""
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=config)
    return kubernetes.client.ApiClient(config)


class OperatorProcess:
    """`kiln operator` as a subprocess with its own kubeconfig (a ServiceAccount token's, so it
    gets exactly the RBAC it is granted), its output appended to `log`."""

    def __init__(self, kubeconfig: Path, log: Path, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.kubeconfig, self.log, self.args, self.env = kubeconfig, log, args, env or {}
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str, interval: float = 300) -> None:
        """Start it with the constructor's arguments plus `args`."""
        env = {**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig)}
        with self.log.open("a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "operator", "--interval", str(interval),
                                          *self.args, *args], env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, *args: str, interval: float = 300, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start(*args, interval=interval)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def tail(self, lines: int = 60) -> str:
        return "---- operator log (tail) ----\n" + "\n".join(self.text().splitlines()[-lines:])


def reconcile_passes(port: int, namespace: str, name: str) -> dict[str, float]:
    """The passes an operator serving /metrics on `port` (`--metrics-port`) has begun over one
    InferenceService, by what they read (fresh, reused)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        page = response.read().decode()
    return {s.labels["read"]: s.value for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == "kiln_operator_reconcile_passes_total"
            and (s.labels["namespace"], s.labels["inferenceservice"]) == (namespace, name)}


def loopback_hosts() -> list[str]:
    """The loopback addresses to reach a server listening on every address, as URL hosts: what a pod
    IP of each family would reach. IPv6 may be off here (a container's sysctl): then IPv4 alone."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return ["127.0.0.1"]
    return ["127.0.0.1", "[::1]"]
