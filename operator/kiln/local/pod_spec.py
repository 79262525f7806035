"""What the local test runtime reads from a pod spec: its environment, its probes, and the
record of one pod's process (`PodRun`). Pure but for reading Secrets and ConfigMaps."""
from __future__ import annotations

import base64
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException

from kiln.local.cluster import urlopen


def field_value(pod: Any, path: str) -> str:
    """The few downward-API fields pods here use."""
    values = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
              "status.podIP": pod.status.pod_ip, "spec.nodeName": pod.spec.node_name,
              "spec.serviceAccountName": pod.spec.service_account_name or "default"}
    if path not in values:
        raise ValueError(f"fieldRef {path} is not supported by the local test runtime")
    return values[path] or ""


def resolve_port(container: Any, port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.ports or []:
        if p.name == port:
            return p.container_port
    raise ValueError(f"container {container.name} has no port named {port!r}")


@dataclass
class Probe:
    url: str
    period: float
    failures: int

    @classmethod
    def of(cls, container: Any, ip: str, kind: str = "readiness") -> Probe | None:
        spec = getattr(container, f"{kind}_probe")
        if spec is None or spec.http_get is None:
            return None
        port = resolve_port(container, spec.http_get.port)
        return cls(f"http://{ip}:{port}{spec.http_get.path or '/'}", float(spec.period_seconds or 10),
                   spec.failure_threshold or 3)

    def check(self) -> bool:
        try:
            with urlopen(self.url, timeout=min(self.period, 2.0)) as resp:
                return 200 <= resp.status < 400
        except (OSError, urllib.error.URLError):
            return False


@dataclass
class PodRun:
    """One pod's process as this runtime runs it."""
    namespace: str
    name: str
    uid: str
    container: str
    ip: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    probe: Probe | None
    grace: float
    prestop: float
    liveness: Probe | None = None
    startup: Probe | None = None
    container_id: str | None = None  # container mode: podman's name for it
    record: dict | None = None
    ready: bool | None = None
    failures: int = 0
    next_probe: float = 0.0
    started: bool = False  # the startup probe passed (or there is none): liveness counts from then
    live_failures: int = 0
    next_live: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    stopping: bool = False
    logs_on_error: bool = False  # terminationMessagePolicy FallbackToLogsOnError
    last_exit: dict | None = None  # the container's lastState.terminated, as a kubelet reports it
    reported: tuple | None = None  # (ready, restarts) as last written to the pod's status

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def netns(self) -> str:
        return f"p{self.uid[:8]}"


class NotYet(ValueError):
    """The pod cannot start yet, for want of something that may come (a Secret, a ConfigMap, an
    image): the runtime says why on the pod and tries again, as a kubelet does. Any other
    ValueError is a spec the runtime will never run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # the kubelet's waiting reason


def key_value(core: Any, namespace: str, ref: Any, secret: bool) -> str | None:
    """A Secret's or ConfigMap's key, as the kubelet gives it to an env var: a missing one holds
    the pod back until it is there, unless the reference is optional (then the variable is unset)."""
    kind = "secret" if secret else "configmap"
    read = core.read_namespaced_secret if secret else core.read_namespaced_config_map
    try:
        data = read(ref.name, namespace).data or {}
    except ApiException as exc:
        if exc.status != 404:
            raise
        data, missing = {}, f"{kind} {ref.name} not found"
    else:
        missing = f"{kind} {ref.name} has no key {ref.key!r}"
    if ref.key not in data:
        if ref.optional:
            return None
        raise NotYet("CreateContainerConfigError", missing)
    return base64.b64decode(data[ref.key]).decode() if secret else data[ref.key]


def pod_env(core: Any, pod: Any) -> dict[str, str]:
    """The environment of the pod's (only) container, as the kubelet makes it."""
    # This node's pods share the machine's few CPUs (the fake node advertises far more than it
    # has), so OpenMP workers must sleep when idle rather than spin: a spinning engine starves
    # the others. A real node's CPU requests give each pod its share; the engine's default
    # (spin between parallel regions) is for that. A pod's own value wins.
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOSTNAME": pod.metadata.name, "OMP_WAIT_POLICY": "PASSIVE"}
    for var in pod.spec.containers[0].env or []:
        source = var.value_from
        if source is None:
            env[var.name] = var.value or ""
        elif source.field_ref is not None:
            env[var.name] = field_value(pod, source.field_ref.field_path)
        elif source.secret_key_ref is not None or source.config_map_key_ref is not None:
            secret = source.secret_key_ref is not None
            value = key_value(core, pod.metadata.namespace, source.secret_key_ref if secret
                              else source.config_map_key_ref, secret)
            if value is not None:
                env[var.name] = value
        else:
            raise ValueError(f"env {var.name}: only value, fieldRef, secretKeyRef and configMapKeyRef "
                             "are supported")
    return env
