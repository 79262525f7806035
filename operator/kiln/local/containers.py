"""The test runtime's container mode: a pod's container as `podman --runtime runc run`, from the
image the pod names (built by `make images`), instead of a process of the development venv.

podman_argv() is a pure function of the pod (and what the runtime resolved for it) to the
`podman run` command line, so it is tested without a container. What it honours:
command/args (Kubernetes' meaning: command replaces the image's ENTRYPOINT, args its CMD), env,
the pod's network namespace (joined: the runtime made it, with the pod's IP; ports need no
mapping there), resources (memory and CPU limits, CPU requests as shares: cgroup limits where
the host has the controllers), securityContext (runAsUser/Group, fsGroup, runAsNonRoot checked
against the image's user, readOnlyRootFilesystem, no privilege escalation, dropped
capabilities), emptyDir and hostPath volumes, and the ServiceAccount token (a kubeconfig
mounted read-only). Anything else a pod asks for is refused with a clear reason.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Collection

from kubernetes.utils import parse_quantity

MODE_ANNOTATION = "kiln.dev/local-runtime"  # "container": run this pod from its image
CLUSTER_LABEL = "dev.kiln.local-cluster"  # on each container: the state directory of its cluster
TOKEN_DIR = "/var/run/secrets/kiln.dev/serviceaccount"  # where the kubeconfig is mounted


def wants_container(pod: Any) -> bool:
    return (pod.metadata.annotations or {}).get(MODE_ANNOTATION) == "container"


def container_name(uid: str) -> str:
    return f"kiln-pod-{uid[:8]}"


def security(pod: Any, container: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod securityContext, container securityContext) as plain dicts of the fields set."""
    def fields(context: Any) -> dict[str, Any]:
        return {k: v for k, v in context.to_dict().items() if v is not None} if context else {}
    return fields(pod.spec.security_context), fields(container.security_context)


def user_option(pod: Any, container: Any, image_user: str) -> list[str]:
    """--user for runAsUser/runAsGroup; runAsNonRoot refused, as the kubelet does, when the
    container would run as root (by its own setting or by the image's USER)."""
    pod_sc, ctr_sc = security(pod, container)
    uid = ctr_sc.get("run_as_user", pod_sc.get("run_as_user"))
    gid = ctr_sc.get("run_as_group", pod_sc.get("run_as_group"))
    non_root = ctr_sc.get("run_as_non_root", pod_sc.get("run_as_non_root"))
    if non_root:
        effective = str(uid) if uid is not None else image_user.split(":")[0]
        if not effective.isdigit():
            raise ValueError(f"runAsNonRoot and the image's user {image_user!r} is not numeric: "
                             "cannot verify it is not root")
        if int(effective) == 0:
            raise ValueError("runAsNonRoot and the container would run as root (uid 0)")
    if uid is None:
        return []
    return ["--user", f"{uid}:{gid}" if gid is not None else str(uid)]


def security_options(pod: Any, container: Any) -> list[str]:
    pod_sc, ctr_sc = security(pod, container)
    opts: list[str] = []
    if ctr_sc.get("read_only_root_filesystem"):
        opts += ["--read-only", "--read-only-tmpfs=false"]  # Kubernetes adds no tmpfs of its own
    if ctr_sc.get("allow_privilege_escalation") is False:
        opts += ["--security-opt", "no-new-privileges"]
    caps = ctr_sc.get("capabilities") or {}
    opts += [f"--cap-drop={c}" for c in caps.get("drop") or []]
    opts += [f"--cap-add={c}" for c in caps.get("add") or []]
    if pod_sc.get("fs_group") is not None:
        opts += ["--group-add", str(pod_sc["fs_group"])]
    if ctr_sc.get("privileged"):
        raise ValueError("privileged containers are not run by the local test runtime")
    return opts


def resource_options(container: Any, cgroup_controllers: set[str]) -> list[str]:
    """Limits as cgroup limits where the host has the controller; GPUs are not passed here."""
    res = container.resources
    limits, requests = (res.limits or {}) if res else {}, (res.requests or {}) if res else {}
    opts: list[str] = []
    if "memory" in limits and "memory" in cgroup_controllers:
        opts += ["--memory", str(int(parse_quantity(limits["memory"])))]
    if "cpu" in cgroup_controllers:
        if "cpu" in limits:
            opts += ["--cpus", f"{float(parse_quantity(limits['cpu'])):g}"]
        if "cpu" in requests:  # the kubelet's mapping: 1 CPU = 1024 shares
            opts += ["--cpu-shares", str(max(2, int(float(parse_quantity(requests["cpu"])) * 1024)))]
    return opts


def volume_options(pod: Any, container: Any, volume_dir: Path) -> list[str]:
    """emptyDir (a directory under volume_dir, or tmpfs for medium Memory) and hostPath mounts."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    opts: list[str] = []
    for mount in container.volume_mounts or []:
        volume = volumes.get(mount.name)
        if volume is None:
            raise ValueError(f"volumeMount {mount.name} names no volume")
        ro = ":ro" if mount.read_only else ""
        if volume.projected is not None and any(source.service_account_token is not None
                                                for source in volume.projected.sources or []):
            continue  # the ServiceAccount's token: given as the kubeconfig instead (TOKEN_DIR)
        if volume.empty_dir is not None and volume.empty_dir.medium == "Memory":
            opts += ["--mount", f"type=tmpfs,destination={mount.mount_path}"]
        elif volume.empty_dir is not None:
            opts += ["--volume", f"{volume_dir / mount.name}:{mount.mount_path}:rw"]
        elif volume.host_path is not None:
            opts += ["--volume", f"{volume.host_path.path}:{mount.mount_path}{ro}"]
        else:
            raise ValueError(f"volume {mount.name}: only emptyDir and hostPath are supported in container mode")
    return opts


def empty_dirs(pod: Any, container: Any) -> list[str]:
    """Names of the emptyDir volumes on disk that the container mounts (made before it starts)."""
    disk = {v.name for v in pod.spec.volumes or [] if v.empty_dir is not None and v.empty_dir.medium != "Memory"}
    return [m.name for m in container.volume_mounts or [] if m.name in disk]


def without_gpus(argv: list[str]) -> list[str]:
    """The command with `--device cuda[:N]` made `--device cpu`. kwok's GPU nodes have no GPUs and
    neither do their pods here (the one part of a GPU pod this runtime fakes), but the operator
    tells an engine given GPUs to use CUDA or refuse to start."""
    return ["cpu" if before == "--device" and arg.startswith("cuda") else arg for before, arg in zip(["", *argv], argv)]


def podman_argv(pod: Any, env: dict[str, str], netns: str, image_user: str, volume_dir: Path,
                cgroup_controllers: set[str], kubeconfig: Path | None, cluster: str = "",
                podman_env: Collection[str] = ()) -> list[str]:
    """The `podman run` command line (without the leading `podman`) for the pod's only container.
    The values of `env` are not on it: podman takes them from its own environment (`--env NAME`),
    so a Secret's does not show in `ps`; but a name that podman's own environment (`podman_env`)
    has (HOME...) keeps its value on the command line, as podman needs its own."""
    container = pod.spec.containers[0]
    argv = ["--runtime", "runc", "run", "--rm", "--name", container_name(pod.metadata.uid),
            "--label", f"{CLUSTER_LABEL}={cluster}",
            "--network", f"ns:/run/netns/{netns}", "--hostname", pod.metadata.name[:63],
            "--pull", "never",
            *user_option(pod, container, image_user), *security_options(pod, container),
            *resource_options(container, cgroup_controllers), *volume_options(pod, container, volume_dir)]
    for name, value in env.items():
        argv += ["--env", f"{name}={value}" if name in podman_env else name]
    if kubeconfig is not None:  # a path, no secret
        argv += ["--volume", f"{kubeconfig.parent}:{TOKEN_DIR}:ro",
                 "--env", f"KUBECONFIG={TOKEN_DIR}/{kubeconfig.name}"]
    if container.command:
        argv += ["--entrypoint", json.dumps(without_gpus(container.command))]
    argv.append(container.image)
    argv += without_gpus(list(container.args or []))
    return argv


def cgroup_controllers() -> set[str]:
    """The cgroup controllers this host has: v2's list, or v1's mounted hierarchies."""
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if unified.exists():
        return set(unified.read_text().split())
    return {p.name for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir() and p.name in ("memory", "cpu")}
