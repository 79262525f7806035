"""Each child object of an InferenceService, rendered from its spec: pure functions, no API
calls. desired.py decides which of them should exist."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import images
from .engine_command import (GRACE_PERIOD_S, PORT, PRESTOP_SLEEP_S, SHM_MOUNT, TMP_MOUNT, engine_args,
                             model_volumes)
from .models import GROUP, KIND, VERSION, InferenceServiceSpec, Toleration, seconds
from .placement import Placement
from .quantity import canonical

DEFAULT_ENGINE_IMAGE = images.image("engine")  # this release's engine
ROUTER_PORT = 8080
# How long a replica may take to load before it counts as stuck, not on its way (the
# Deployment's progress deadline; the engine's /health answers while it loads).
LOAD_DEADLINE_S = 1800
LABEL_ISVC = "kiln.dev/inferenceservice"
LABEL_REVISION = "kiln.dev/revision"
LABEL_COMPONENT = "kiln.dev/component"
ANNOTATION_QUANTIZATION = "kiln.dev/quantization"
# With a warm pool, engine pods are born standbys ("false") and the operator promotes them to
# "true"; a revision's Service then selects only "true" (warmpool.py).
LABEL_SERVING = "kiln.dev/serving"
ROUTER_CLUSTER_ROLE = "kiln-router"
API_KEYS_ENV = "KILN_API_KEYS"  # what `kiln router` reads its keys from (kiln.router.auth)  # shipped in manifests/base/rbac.yaml
# A router keeps taking requests while its endpoint is removed everywhere, then gets SIGTERM
# and finishes its streams (kiln router's own shutdown timeout is 25 s).
ROUTER_PRESTOP_SLEEP_S = 5
ROUTER_GRACE_PERIOD_S = 40
RUN_AS = 10001  # above 10000: no clash with a host user's id


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


def engine_image() -> str:
    return os.environ.get("KILN_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE)


def operator_namespace() -> str:
    """Where this operator runs (its pod's namespace, from the downward API)."""
    return os.environ.get("POD_NAMESPACE", "kiln-system")


def revision_name(name: str, spec: InferenceServiceSpec) -> str:
    """<isvc>-<hash of model+engine>. Defaults are left out of the hash, so spelling a default
    out, or a new operator version adding a defaulted field, starts no rollout."""
    settings = {"model": spec.model.model_dump(mode="json", exclude_defaults=True),
                "engine": spec.engine.model_dump(mode="json", exclude_defaults=True)}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return f"{name}-{digest[:8]}"


def selector(name: str, component: str = "engine") -> dict[str, str]:
    return {LABEL_ISVC: name, LABEL_COMPONENT: component}


def selector_string(name: str, component: str = "engine") -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name, component).items())


def scale_selector(name: str) -> str:
    """/scale's selector (status.selector): the engine pods that serve. An HPA averages its pods
    metric over them, and a warm pool's standbys (load 0) held it within tolerance of no change.
    `notin`, not `!=`: the HPA controller parses it as a LabelSelector, which has no `!=`."""
    return f"{selector_string(name)},{LABEL_SERVING} notin (false)"


def labels(name: str, component: str = "engine") -> dict[str, str]:
    return {"app.kubernetes.io/name": f"kiln-{component}", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/managed-by": "kiln-operator", **selector(name, component)}


def metadata(owner: Owner, name: str, extra_labels: dict[str, str] | None = None,
             component: str = "engine") -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**labels(owner.name, component), **(extra_labels or {})},
        "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name,
                             "uid": owner.uid, "controller": True, "blockOwnerDeletion": True}],
    }


# A tensor-parallel pod's ranks: NCCL's intra-node transport keeps its buffers in /dev/shm
# (the container runtime's default is 64 MiB); a memory-backed emptyDir counts against the pod's
# memory limit, so it is capped. A failed collective aborts the process (the engine dies loudly)
# instead of hanging, and NCCL logs only its warnings.
SHM_SIZE = "1Gi"
NCCL_ENV = [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"}]


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    res = spec.resources
    # Canonical, as stored: `1.5Gi` rendered as written would differ from the stored `1536Mi`
    # on every pass (plan.py compares strings) and be patched back forever.
    requests = {"cpu": canonical(res.cpu), "memory": canonical(res.memory)}
    # No CPU limit: throttling a decode loop only adds latency. Memory is capped to be evictable.
    limits: dict[str, str] = {"memory": canonical(res.memory)}
    if res.gpus > 0:
        limits["nvidia.com/gpu"] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"}}


def pooled(spec: InferenceServiceSpec) -> bool:
    """Whether the spec keeps a warm pool (its pods are born standbys)."""
    return spec.warmPool is not None and spec.warmPool.size > 0


def template_pooled(deployment: dict[str, Any]) -> bool:
    """Whether a stored engine Deployment makes its pods as standbys."""
    template = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    return LABEL_SERVING in (template.get("labels") or {})


def render_deployment(owner: Owner, spec: InferenceServiceSpec, image: str,
                      pod_annotations: dict[str, str] | None = None) -> dict[str, Any]:
    revision = revision_name(owner.name, spec)
    pod_labels = {**labels(owner.name), LABEL_REVISION: revision,
                  **({LABEL_SERVING: "false"} if pooled(spec) else {})}
    model_arg, draft_arg, lora_modules, volumes, mounts = model_volumes(spec)
    volumes = [{"name": "tmp", "emptyDir": {}}, *volumes]
    mounts = [{"name": "tmp", "mountPath": TMP_MOUNT}, *mounts]
    env = [{"name": "HOME", "value": TMP_MOUNT}]
    if spec.engine.tensorParallelSize > 1:  # GPU ranks (the CRD's rule) exchange tensors through shared memory
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "dshm", "mountPath": SHM_MOUNT})
        env += NCCL_ENV
    mine = {e.name for e in spec.engine.env}
    env = [e for e in env if e["name"] not in mine] + [e.model_dump(exclude_none=True) for e in spec.engine.env]
    container = {
        "name": "engine",
        "image": image,
        "command": engine_args(spec, model_arg, draft_arg, lora_modules),
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": container_resources(spec),
        # Loading weights and warming kernels can take minutes: the startup probe allows 30, on
        # /ready (/health answers from the moment the server listens, so a load that hung, on a
        # stalled volume say, passed it and was never restarted).
        "startupProbe": probe("/ready", 5, 360),
        # Probed often: a replica that turns ready releases the requests held at zero.
        "readinessProbe": probe("/ready", 2, 3),
        "livenessProbe": probe("/health", 10, 3),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": HARDENED,
        "volumeMounts": mounts,
        # A failed start's last log lines become the container's termination message, which the
        # ModelLoaded condition quotes (the engine's one-line error names what is wrong).
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": GRACE_PERIOD_S,
        "securityContext": POD_SECURITY,
    }
    pod_spec.update(pull_secrets(spec))
    pod_spec.update(placement_fields(spec.resources.nodeSelector, spec.resources.tolerations))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**metadata(owner, revision, {LABEL_REVISION: revision}),
                     "annotations": {ANNOTATION_QUANTIZATION: spec.engine.quantization}},
        # No replicas: that field has its own writer (desired.replicas_writer).
        "spec": {
            "selector": {"matchLabels": {**selector(owner.name), LABEL_REVISION: revision}},
            # Never drop below the wanted capacity while a replica reloads weights.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": LOAD_DEADLINE_S,
            "revisionHistoryLimit": 2,
            "template": {"metadata": pod_metadata(pod_labels, pod_annotations), "spec": pod_spec},
        },
    }


def pull_secrets(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The pod spec's imagePullSecrets, absent when none are given (as the API server stores it)."""
    return {"imagePullSecrets": [{"name": s.name} for s in spec.imagePullSecrets]} if spec.imagePullSecrets else {}


def pod_metadata(pod_labels: dict[str, str], annotations: dict[str, str] | None) -> dict[str, Any]:
    return {"labels": pod_labels, **({"annotations": dict(annotations)} if annotations else {})}


def router_name(name: str) -> str:
    return f"{name}-router"


def render_service(owner: Owner) -> dict[str, Any]:
    """The user-facing Service: the router pods, which spread requests over the engines."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, owner.name, component="router"),
        "spec": {"type": "ClusterIP", "selector": selector(owner.name, "router"),
                 "ports": [{"name": "http", "port": PORT, "targetPort": "http",
                            "protocol": "TCP", "appProtocol": "http"}]},
    }


def render_revision_service(owner: Owner, revision: str, pooled: bool = False) -> dict[str, Any]:
    """Headless, one per revision: nobody connects to it. Its EndpointSlices (which carry its
    labels, revision included) are how the router sees each revision's ready pods; with a warm
    pool, only its serving ones (standbys are never routed)."""
    serving = {LABEL_SERVING: "true"} if pooled else {}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, revision, {LABEL_REVISION: revision}),
        "spec": {"clusterIP": "None", "selector": {**selector(owner.name), LABEL_REVISION: revision, **serving},
                 "ports": [{"name": "http", "port": PORT, "targetPort": "http",
                            "protocol": "TCP", "appProtocol": "http"}]},
    }


def render_router_account(owner: Owner) -> list[dict[str, Any]]:
    """The router's ServiceAccount, bound in its namespace only to the fixed `kiln-router`
    ClusterRole that manifests/ installs (list/watch EndpointSlices)."""
    name = router_name(owner.name)
    meta = metadata(owner, name, component="router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROUTER_CLUSTER_ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]


def placement_fields(node_selector: dict[str, str], tolerations: Sequence[Toleration]) -> dict[str, Any]:
    """A pod spec's nodeSelector and tolerations, each left out when empty."""
    fields: dict[str, Any] = {}
    if node_selector:
        fields["nodeSelector"] = dict(node_selector)
    if tolerations:
        # An empty key or value means what leaving it out does, and the API server stores it left
        # out (omitempty): rendered, the Deployment never matched what was stored and was applied
        # again on every pass.
        fields["tolerations"] = [{k: v for k, v in t.model_dump(exclude_none=True).items() if v != ""}
                                 for t in tolerations]
    return fields


def render_router(owner: Owner, spec: InferenceServiceSpec, image: str,
                  pod_annotations: dict[str, str] | None = None, placement: Placement = Placement()
                  ) -> dict[str, Any]:
    """One router per InferenceService, in front of every revision's engine pods. With
    `spec.auth` its API keys come from the Secret as an environment variable (a rotated key
    needs the router restarted: `kubectl rollout restart deployment/<name>-router`). It runs the
    engine image on the CPU, so it goes where CPU engines go (`placement`: the operator's CPU
    defaults; the service's own nodeSelector and tolerations are its engines')."""
    name = router_name(owner.name)
    env: list[dict[str, Any]] = [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    if spec.auth is not None:
        ref = spec.auth.apiKeySecretRef
        env.append({"name": API_KEYS_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    command = ["kiln", "router", "--selector", selector_string(owner.name), "--port", str(ROUTER_PORT),
               "--inference-service", owner.name]
    if spec.autoscaling is not None and spec.autoscaling.activationTimeout is not None:
        command += ["--activation-timeout", f"{seconds(spec.autoscaling.activationTimeout):g}"]
    container = {
        "name": "router",
        "image": image,  # the engine image carries the whole `kiln` CLI
        "command": command,
        "env": env,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        # Ready once it can take requests, engines or not: at zero replicas it is what holds them.
        "readinessProbe": probe("/ready", 2, 2),
        "livenessProbe": probe("/health", 10, 3),
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SLEEP_S}}},
        "securityContext": HARDENED,
        # The Kubernetes client writes the API server's CA to a temporary file: on a read-only
        # root filesystem it needs a writable /tmp.
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_labels = labels(owner.name, "router")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, name, component="router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector(owner.name, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 2,
            "template": {"metadata": pod_metadata(pod_labels, pod_annotations), "spec": {
                "serviceAccountName": name,
                "automountServiceAccountToken": True,  # to watch EndpointSlices and its InferenceService
                "enableServiceLinks": False,
                "containers": [container],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
                "terminationGracePeriodSeconds": ROUTER_GRACE_PERIOD_S,
                "securityContext": POD_SECURITY,
                **pull_secrets(spec),
                **placement_fields(placement.node_selector, placement.tolerations),
            }},
        },
    }


def render_network_policies(owner: Owner, operator_namespace: str) -> list[dict[str, Any]]:
    """Engine pods take connections only from their own router pods and from the operator (its
    autoscaler scrapes /metrics, the warm pool's sleep and wake), and open none (replies to those
    are allowed: policies are stateful); the kubelet's probes come from the node, which policies
    do not filter. A Prometheus scraping the engines needs a policy of its own beside this one
    (policies add up). The router is the front door (it checks API keys): anyone may connect, and
    it may connect out (to engines, and to the API server, whose address no policy can name
    portably)."""
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kiln-operator"}}}
    http = [{"protocol": "TCP", "port": "http"}]
    engines = {"podSelector": {"matchLabels": selector(owner.name)}, "policyTypes": ["Ingress", "Egress"],
               "ingress": [{"from": [{"podSelector": {"matchLabels": selector(owner.name, "router")}}, operator],
                            "ports": http}]}  # Egress with no rule: none allowed (an empty list is not stored)
    router = {"podSelector": {"matchLabels": selector(owner.name, "router")}, "policyTypes": ["Ingress", "Egress"],
              "ingress": [{"ports": http}], "egress": [{}]}
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": metadata(owner, f"{owner.name}-{which}", component=component), "spec": spec}
            for which, component, spec in (("engines", "engine", engines), ("router", "router", router))]


def render_pdbs(owner: Owner) -> list[dict[str, Any]]:
    """One budget for the engine pods and one for the routers: one pod of each may be evicted
    at a time (maxUnavailable, not minAvailable: a single replica must not block node drains
    forever; with two routers, one always stays up). Named <name>-engine and <name>-router: the
    engine's was <name>, which is the router's of an InferenceService named without "-router"
    (`a` and `a-router`), and the second of the two was refused as someone else's object. The
    plan deletes an older operator's <name> budget as it makes the new one."""
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
             "metadata": metadata(owner, name, component=component),
             "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner.name, component)},
                      "unhealthyPodEvictionPolicy": "AlwaysAllow"}}
            for name, component in ((f"{owner.name}-engine", "engine"), (router_name(owner.name), "router"))]


def service_url(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{PORT}/v1"
