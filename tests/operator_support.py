"""Helpers for the operator's tests against the real local control plane (tests/test_operator*.py);
their fixtures (operator, apis, ns) are in conftest.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.rest import ApiException

from kiln.local.testing import eventually, reconcile_passes

REPO = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "kiln.dev", "v1alpha1", "inferenceservices"


def absent(read) -> bool:
    try:
        read()
    except ApiException as err:
        return err.status == 404
    return False


def until(check, what: str, timeout: float = 90.0) -> Any:
    return eventually(check, what, timeout=timeout, ignore=(ApiException,))


def smollm2(name: str = "smollm2", gpus: int = 0) -> dict[str, Any]:
    """examples/smollm2.yaml, on CPU unless asked: the kwok nodes' 8 GPUs must last the module."""
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = name
    body["spec"]["resources"]["gpus"] = gpus
    if gpus > 1:  # one rank per GPU
        body["spec"]["engine"]["tensorParallelSize"] = gpus
    return body


def isvc(apis, ns: str, name: str) -> dict[str, Any]:
    return apis["custom"].get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def ready(apis, ns: str, name: str) -> dict[str, Any] | None:
    """The isvc once Ready is True for its current generation."""
    obj = isvc(apis, ns, name)
    status = obj.get("status") or {}
    current = status.get("observedGeneration") == obj["metadata"]["generation"]
    return obj if current and condition(obj, "Ready").get("status") == "True" else None


def engines(name: str) -> str:
    """Label selector of an InferenceService's engine pods (its router's pods are not engines)."""
    return f"kiln.dev/inferenceservice={name},kiln.dev/component=engine"


def engine_deployments(apis, ns: str, name: str) -> list:
    return apis["apps"].list_namespaced_deployment(ns, label_selector=engines(name)).items


def events(apis, ns: str, name: str) -> list:
    """The Events about an InferenceService that the API server stored, oldest first (timestamps
    have whole seconds; within one, etcd's ever-growing resourceVersion keeps the order)."""
    found = apis["core"].list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    return sorted((e for e in found if e.involved_object.kind == "InferenceService"),
                  key=lambda e: (e.first_timestamp, int(e.metadata.resource_version)))


def event_reasons(apis, ns: str, name: str, type_: str | None = None) -> set[str]:
    return {e.reason for e in events(apis, ns, name) if type_ in (None, e.type)}


def apply(kubectl, ns: str, body: dict) -> None:
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))


def history(apis, ns: str, name: str) -> list[str]:
    """'Type=Status reason' of each condition Event, oldest first."""
    return [f"{e.message.split(':')[0]} {e.reason}" for e in events(apis, ns, name) if "=" in e.message.split(":")[0]]


def passes(port: int, ns: str, name: str) -> float:
    """Reconcile passes the operator serving /metrics on `port` has begun over one
    InferenceService, fresh reads and reused ones; 0 while it does not serve them yet."""
    try:
        return sum(reconcile_passes(port, ns, name).values())
    except OSError:  # (URLError too) a process just started: not listening yet
        return 0.0


def a_pass_ran(port: int, ns: str, name: str, since: float | None = None) -> None:
    """Returns once a whole reconcile pass over the InferenceService began and ended after this
    call (or after the count was `since`: 0 for an operator just started). The counter goes up
    as a pass begins, and passes over one object never overlap: two more passes begun means the
    first of them has ended, its writes and Events made."""
    base = passes(port, ns, name) if since is None else since
    until(lambda: passes(port, ns, name) >= base + 2, f"a whole reconcile pass over {name}")
