"""One idempotent reconcile: apply the desired children, retire old revisions, report status.
Every trigger (create, update, resume, the resync timer) runs the same function, so a
deleted or hand-edited child is put back on the next pass."""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import kopf
import kubernetes
import pydantic
from kubernetes.client.rest import ApiException

from .desired import Owner, desired_children, desired_replicas, selector_string, service_url
from .models import GROUP, PLURAL, VERSION, InferenceServiceSpec
from .status import stale_revisions, summarize, transitions

FIELD_MANAGER = "kiln-operator"
APPLY = "application/apply-patch+yaml"
WARNING_REASONS = {"NotImplemented", "ProgressDeadlineExceeded"}


@dataclass(frozen=True)
class Api:
    """Typed clients over one connection, made once per operator process."""
    client: kubernetes.client.ApiClient
    core: kubernetes.client.CoreV1Api
    apps: kubernetes.client.AppsV1Api
    policy: kubernetes.client.PolicyV1Api
    custom: kubernetes.client.CustomObjectsApi
    rbac: kubernetes.client.RbacAuthorizationV1Api

    @classmethod
    def connect(cls) -> Api:
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()  # $KUBECONFIG or ~/.kube/config
        client = kubernetes.client.ApiClient()
        return cls(client, kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client),
                   kubernetes.client.PolicyV1Api(client), kubernetes.client.CustomObjectsApi(client),
                   kubernetes.client.RbacAuthorizationV1Api(client))

    def patcher(self, kind: str) -> Callable[..., Any]:
        return {"Deployment": self.apps.patch_namespaced_deployment,
                "Service": self.core.patch_namespaced_service,
                "PodDisruptionBudget": self.policy.patch_namespaced_pod_disruption_budget,
                "ServiceAccount": self.core.patch_namespaced_service_account,
                "Role": self.rbac.patch_namespaced_role,
                "RoleBinding": self.rbac.patch_namespaced_role_binding}[kind]


def apply(api: Api, obj: dict[str, Any]) -> None:
    """Server-side apply, forcing ownership back from anyone who hand-edited our fields."""
    meta = obj["metadata"]
    api.patcher(obj["kind"])(meta["name"], meta["namespace"], obj, field_manager=FIELD_MANAGER,
                             force=True, _content_type=APPLY)


def list_revisions(api: Api, owner: Owner, component: str = "engine") -> list[dict[str, Any]]:
    """The engine revisions' Deployments (or, with component="router", the router's)."""
    found = api.apps.list_namespaced_deployment(owner.namespace,
                                                label_selector=selector_string(owner.name, component))
    deployments = api.client.sanitize_for_serialization(found)["items"]
    # A same-named service deleted and recreated must not adopt its predecessor's leftovers.
    return [d for d in deployments
            if any(ref.get("uid") == owner.uid for ref in d["metadata"].get("ownerReferences", []))]


def retire(api: Api, body: Mapping[str, Any], namespace: str, name: str) -> None:
    try:
        api.apps.delete_namespaced_deployment(name, namespace)
    except ApiException as err:
        if err.status != 404:
            raise
    kopf.event(body, type="Normal", reason="RevisionRetired", message=f"deleted old revision {name}")


def parse_spec(body: Mapping[str, Any]) -> InferenceServiceSpec:
    try:
        return InferenceServiceSpec.model_validate(dict(body["spec"]))
    except pydantic.ValidationError as err:
        # The CRD schema should have stopped this; retrying cannot help.
        raise kopf.PermanentError(f"spec does not match this operator's models: {err}") from err


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(body: Mapping[str, Any], api: Api, image: str, logger: logging.Logger,
              pod_annotations: dict[str, str] | None = None) -> None:
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return  # garbage collection removes the children through their owner references
    owner = Owner(meta["name"], meta["namespace"], meta["uid"])
    spec = parse_spec(body)
    children = desired_children(owner, spec, image, pod_annotations)
    for obj in children.all():
        apply(api, obj)
    deployments = list_revisions(api, owner)
    stale = stale_revisions(children.revision, deployments, desired_replicas(spec))
    for name in stale:
        retire(api, body, owner.namespace, name)
    previous = dict(body.get("status") or {})
    status = summarize(spec=spec, generation=meta.get("generation") or 0, revision=children.revision,
                       deployments=[d for d in deployments if d["metadata"]["name"] not in stale],
                       previous=previous, url=service_url(owner), selector=selector_string(owner.name),
                       now=now(), router=next(iter(list_revisions(api, owner, "router")), None))
    if any(previous.get(key) != value for key, value in status.items()):
        api.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, owner.namespace, PLURAL, owner.name, {"status": status},
            _content_type="application/merge-patch+json")
        logger.debug("status written: %s", status)
    for cond in transitions(previous, status):
        kopf.event(body, type="Warning" if cond["reason"] in WARNING_REASONS else "Normal",
                   reason=cond["reason"], message=f"{cond['type']}={cond['status']}: {cond['message']}")
