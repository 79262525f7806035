"""What kwok simulates: two GPU nodes and the lifecycle of pods bound to them.

kwok acts on Stage objects (a selector over the resource plus the status to write). Ours:
nodes become Ready keeping the capacity they were created with; pods on our nodes become
Running with an IP from their node's podCIDR (a slice of the bridge subnet) and Ready,
unless annotated `kiln.dev/readiness: external`, which leaves Ready to the test runtime
that runs the pod's process; pods being deleted are removed (there is no kubelet), except
annotated ones: the test runtime removes those once their process has stopped, so that
their IP is not handed to a new pod while the old process still drains on it.
"""
from __future__ import annotations

NODE_ANNOTATION = "kiln.dev/kwok"  # kwok manages only nodes carrying it
EXTERNAL_READINESS = "kiln.dev/readiness"
NODE_CAPACITY = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "4"}

NODE_READY = """
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: kiln-node-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - {key: .status.phase, operator: NotIn, values: [Running]}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - type: Ready
        status: "True"
        reason: KubeletReady
        message: simulated by kwok
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      addresses:
      - {type: InternalIP, address: {{ NodeIP | Quote }}}
      - {type: Hostname, address: {{ .metadata.name | Quote }}}
      capacity:
      {{ YAML .status.capacity 1 }}
      allocatable:
      {{ YAML .status.capacity 1 }}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
      phase: Running
"""

# `ready` is filled in per stage: "True" for ordinary pods, "False" for external readiness.
POD_RUNNING = """
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: %(name)s}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
    - {key: '.metadata.annotations["%(annotation)s"]', operator: %(operator)s}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "%(ready)s", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "%(ready)s", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: %(ready_bool)s
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      {{ with NodeIPsWith .spec.nodeName }}
      hostIP: {{ index . 0 | Quote }}
      hostIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      {{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
      podIP: {{ index . 0 | Quote }}
      podIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
"""

POD_DELETE = """
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: kiln-pod-delete}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: Exists}
    - {key: '.metadata.annotations["%(annotation)s"]', operator: DoesNotExist}
  next:
    delete: true
"""


def stages_yaml() -> str:
    ordinary = POD_RUNNING % {"name": "kiln-pod-ready", "annotation": EXTERNAL_READINESS,
                              "operator": "DoesNotExist", "ready": "True", "ready_bool": "true"}
    external = POD_RUNNING % {"name": "kiln-pod-started", "annotation": EXTERNAL_READINESS,
                              "operator": "Exists", "ready": "False", "ready_bool": "false"}
    return "---".join([NODE_READY, ordinary, external, POD_DELETE % {"annotation": EXTERNAL_READINESS}])


def node_manifest(name: str, pod_cidr: str) -> dict:
    """A Node with GPU capacity that kwok will keep Ready; pods on it get IPs from pod_cidr."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {NODE_ANNOTATION: "true"},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok",
                                "nvidia.com/gpu.present": "true"}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"capacity": dict(NODE_CAPACITY), "allocatable": dict(NODE_CAPACITY)},
    }
