"""The Kubernetes API as the operator calls it: typed clients over one connection, and the
same verbs on every namespaced child kind."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Each call's limit unless it sets its own. The client sets none: a call on a connection that went
# dead without a reset (an API server gone behind a load balancer) blocked its pass, and so that
# object's reconciles, or the Lease's renewal, for good.
REQUEST_TIMEOUT_S = (5.0, 30.0)  # (connect, read)


def timed(client: kubernetes.client.ApiClient, timeout: tuple[float, float] = REQUEST_TIMEOUT_S
          ) -> kubernetes.client.ApiClient:
    """`client`, its calls limited to `timeout` unless they say otherwise."""
    request = client.rest_client.request

    def limited(*args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(*args, _request_timeout=_request_timeout or timeout, **kwargs)
    client.rest_client.request = limited
    return client

import kubernetes
from kubernetes.client.rest import ApiException


@dataclass(frozen=True)
class Api:
    """Typed clients over one connection, made once per operator process."""
    client: kubernetes.client.ApiClient
    core: kubernetes.client.CoreV1Api
    apps: kubernetes.client.AppsV1Api
    policy: kubernetes.client.PolicyV1Api
    custom: kubernetes.client.CustomObjectsApi
    rbac: kubernetes.client.RbacAuthorizationV1Api
    autoscaling: kubernetes.client.AutoscalingV2Api
    extensions: kubernetes.client.ApiextensionsV1Api
    networking: kubernetes.client.NetworkingV1Api
    # Raises while this replica may not write (leader election's Leadership.check): called before
    # each write, so a pass that outlives its Lease stops writing instead of racing the next leader.
    fence: Callable[[], None] = lambda: None

    @classmethod
    def connect(cls) -> Api:
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()  # $KUBECONFIG or ~/.kube/config
        return cls.of(timed(kubernetes.client.ApiClient()))

    @classmethod
    def of(cls, client: kubernetes.client.ApiClient) -> Api:
        k = kubernetes.client
        return cls(client, k.CoreV1Api(client), k.AppsV1Api(client), k.PolicyV1Api(client),
                   k.CustomObjectsApi(client), k.RbacAuthorizationV1Api(client), k.AutoscalingV2Api(client),
                   k.ApiextensionsV1Api(client), k.NetworkingV1Api(client))

    def call(self, verb: str, kind: str) -> Callable[..., Any]:
        """The client method for `verb` (list, patch, delete) on a namespaced child kind, all
        called as (namespace or name, namespace, ...) like the typed clients' methods."""
        if kind == "ScaledObject":  # a custom resource: group, version and plural go first
            method = getattr(self.custom, f"{verb}_namespaced_custom_object")
            if verb == "list":
                return lambda ns, **kw: method("keda.sh", "v1alpha1", ns, "scaledobjects", **kw)
            return lambda name, ns, *args, **kw: method("keda.sh", "v1alpha1", ns, "scaledobjects", name, *args, **kw)
        where = {"Deployment": (self.apps, "deployment"), "Service": (self.core, "service"),
                 "PodDisruptionBudget": (self.policy, "pod_disruption_budget"),
                 "ServiceAccount": (self.core, "service_account"), "RoleBinding": (self.rbac, "role_binding"),
                 "HorizontalPodAutoscaler": (self.autoscaling, "horizontal_pod_autoscaler"),
                 "NetworkPolicy": (self.networking, "network_policy")}
        api, name = where[kind]
        return getattr(api, f"{verb}_namespaced_{name}")

    def installed(self, crd: str) -> bool:
        try:
            self.extensions.read_custom_resource_definition(crd)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True
