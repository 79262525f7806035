"""`kiln local runtime`: a TEST pod runtime for the local cluster, standing in for the kubelet.

By default it is not a container runtime: no images, no isolation beyond a network namespace, no
resource limits, no volumes. A pod annotated `kiln.dev/local-runtime: container` is run from its
image instead, with podman and runc (kiln.local.containers: limits, securityContext, volumes).
It exists so that the whole system
(operator -> Deployments -> engine and router pods -> Services) can run for real on one
machine. Only pods that opt in are run: an `kiln.dev/readiness` annotation (which also tells
kwok to leave readiness alone, see kiln.local.kwok) and a container command that is
`kiln serve ...` or `kiln router ...`. For each such pod it:

- makes a network namespace holding the pod's IP (kwok assigned it from the bridge range),
- runs the command (with `--device cuda` made `--device cpu`: GPU nodes here have no GPUs) with the pod's args and env (values, a few fieldRefs, secretKeyRefs, configMapKeyRefs) as a local process in it, through this
  venv's Python (`python -m kiln.cli`), with a ServiceAccount token kubeconfig when the pod
  mounts a token (reached through a relay on the bridge gateway: the apiserver listens on
  loopback only, which a namespace cannot see),
- probes the readiness probe's HTTP endpoint and writes Ready/ContainersReady into the pod status,
  and the liveness probe's (after the startup probe's first success): a live-probe failure restarts it,
- on pod deletion runs the preStop sleep, then SIGTERM, the grace period, SIGKILL.

Everything lives under the cluster's state directory, so `kiln local down` removes it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import kubernetes
from kubernetes.client.rest import ApiException

from kiln.local import containers, images, kwok, processes
from kiln.local.cluster import TOKEN_SECONDS, Cluster
from kiln.local.network import PodNetwork
from kiln.local.pod_spec import NotYet, PodRun, Probe, pod_env
from kiln.local.relay import Relay
from kiln.local.testing import api_client, service_account_kubeconfig

log = logging.getLogger("kiln.local.runtime")
RUNNABLE = {("kiln", "serve"), ("kiln", "router")}
TICK_S = 0.5
RESTART_BACKOFF_S = 5.0
NOT_YET_RETRY_S = 2.0  # a pod waiting for a Secret, ConfigMap or image: how often to look again
SHUTDOWN_GRACE_S = 5.0  # when the runtime itself stops (kiln local down): within `down`'s 10 s for it
STOP_ATTEMPTS = 3  # a pod's stop (kill, then its network namespace) that fails is tried again


def runnable(pod: Any) -> bool:
    """Pods this runtime runs: opted in, scheduled, with a kiln engine/router command."""
    annotations = pod.metadata.annotations or {}
    if kwok.EXTERNAL_READINESS not in annotations or not pod.spec.node_name:
        return False
    containers = pod.spec.containers or []
    return len(containers) == 1 and tuple((containers[0].command or [])[:2]) in RUNNABLE


class Runtime:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        state = cluster.state()
        self.net: PodNetwork = cluster.network(state)
        self.admin = api_client(cluster.kubeconfig)
        self.core = kubernetes.client.CoreV1Api(self.admin)
        self.relay = Relay((self.net.gateway, 0), ("127.0.0.1", state["ports"]["apiserver"]))
        self.pods: dict[str, PodRun] = {}  # by uid
        self.refused: set[str] = set()  # pods whose spec this runtime will never run
        self.not_yet: dict[str, tuple[float, str]] = {}  # uid -> (when to try again, why it waits)
        self.stopping = threading.Event()
        self.workdir = cluster.dir / "pods"

    # -- the loop: level-based, like a kubelet's sync loop, over a fresh list each tick --
    def serve(self) -> None:
        self.relay.start()
        log.info("pod runtime up; API relay at %s:%d", *self.relay.address)
        while not self.stopping.is_set():
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - an API hiccup: keep running pods, try again
                log.exception("sync failed; retrying")
            self.stopping.wait(TICK_S)
        self.shutdown()

    def sync(self) -> None:
        live = {p.metadata.uid: p for p in self.core.list_pod_for_all_namespaces(_request_timeout=10).items}
        for uid, run in list(self.pods.items()):
            pod = live.get(uid)
            if not run.stopping and (pod is None or pod.metadata.deletion_timestamp is not None):
                grace = run.grace if pod is None else float(pod.metadata.deletion_grace_period_seconds or run.grace)
                self.stop_later(run, grace)
        self.refused &= live.keys()  # forget pods that are gone, or a long-lived runtime grows
        self.not_yet = {uid: entry for uid, entry in self.not_yet.items() if uid in live}
        for uid, pod in live.items():
            if pod.metadata.deletion_timestamp is not None:
                if uid not in self.pods and kwok.EXTERNAL_READINESS in (pod.metadata.annotations or {}):
                    self.remove(pod)  # nothing (left) running: what a kubelet does after stopping it
            elif uid not in self.pods and uid not in self.refused and runnable(pod) and pod.status.pod_ip \
                    and self.not_yet.get(uid, (0.0, ""))[0] <= time.monotonic():
                # kwok may hand a terminating pod's address to its replacement while the old
                # process still runs its preStop pause: two namespaces with one address would
                # split that address's traffic between them. The new pod starts once it is free.
                if not any(run.ip == pod.status.pod_ip for run in list(self.pods.values())):  # stop threads pop
                    try:
                        self.start(pod)
                    except Exception:  # noqa: BLE001 - one pod's trouble (podman missing...) must not stall the rest
                        log.exception("starting %s/%s failed; retrying", pod.metadata.namespace, pod.metadata.name)
        for run in list(self.pods.values()):
            if not run.stopping:
                self.check(run)

    def start(self, pod: Any) -> None:
        try:
            run = self.plan(pod)
        except NotYet as exc:  # a Secret, ConfigMap or image that may yet come: try again
            self.wait(pod, exc.reason, str(exc))
            return
        except ValueError as exc:
            self.refused.add(pod.metadata.uid)  # the spec will not change: no retry
            self.wait(pod, "CreateContainerError", f"the local test runtime cannot run this pod: {exc}")
            return
        self.not_yet.pop(pod.metadata.uid, None)
        self.net.create_namespace(run.netns, run.ip)
        try:
            self.launch(run)
        except BaseException:  # the pod may be deleted before a retry: leave no namespace behind
            self.net.delete_namespace(run.netns)
            raise
        self.pods[run.uid] = run  # only once launched: a failed start is tried again from the start

    def remove(self, pod: Any) -> None:
        """Delete a pod for good; kwok leaves annotated pods to us (see kiln.local.kwok)."""
        try:
            # In the body: a body's absent gracePeriodSeconds would override the query parameter.
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                            body={"gracePeriodSeconds": 0, "preconditions": {"uid": pod.metadata.uid}})
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or a new pod of the same name
                raise

    def plan(self, pod: Any) -> PodRun:
        container = pod.spec.containers[0]
        env = pod_env(self.core, pod)
        kubeconfig = (self.service_account_kubeconfig(pod)
                      if pod.spec.automount_service_account_token is not False else None)
        if containers.wants_container(pod):
            argv, name = self.container_argv(pod, env, kubeconfig), containers.container_name(pod.metadata.uid)
        else:
            if kubeconfig is not None:
                env["KUBECONFIG"] = str(kubeconfig)
            # `kiln` is this venv's CLI; the image named in the pod spec is not used.
            argv = [*self.net.exec_prefix(f"p{pod.metadata.uid[:8]}"), sys.executable, "-m", "kiln.cli",
                    *containers.without_gpus([*container.command[1:], *(container.args or [])])]
            name = None
        prestop = 0.0
        hook = container.lifecycle.pre_stop if container.lifecycle else None
        if hook is not None and getattr(hook, "sleep", None) is not None:
            prestop = float(hook.sleep.seconds)
        run = PodRun(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, container.name,
                      pod.status.pod_ip, argv, env,
                      self.cluster.dir / "logs" / "pods" / f"{pod.metadata.namespace}_{pod.metadata.name}.log",
                      Probe.of(container, pod.status.pod_ip),
                      float(pod.spec.termination_grace_period_seconds or 30), prestop,
                      *((Probe.of(container, pod.status.pod_ip, "liveness"), Probe.of(container, pod.status.pod_ip, "startup"))
                        if name else (None, None)), name)
        run.logs_on_error = container.termination_message_policy == "FallbackToLogsOnError"
        return run

    def container_argv(self, pod: Any, env: dict[str, str], kubeconfig: Path | None) -> list[str]:
        """`podman run` for the pod (container mode): its image as it is in local storage."""
        container = pod.spec.containers[0]
        if not images.exists(container.image):
            raise NotYet("ErrImageNeverPull", f"image {container.image} is not in local storage: build it (`make images`)")
        image_user = images.inspect(container.image, "{{.Config.User}}")
        pod_sc, container_sc = containers.security(pod, container)
        uid = container_sc.get("run_as_user", pod_sc.get("run_as_user"))
        volumes = self.workdir / pod.metadata.uid / "volumes"
        for name in containers.empty_dirs(pod, container):
            (volumes / name).mkdir(parents=True, exist_ok=True)
            (volumes / name).chmod(0o777)  # as the kubelet makes an emptyDir
        if kubeconfig is not None and uid is not None:
            os.chown(kubeconfig, int(uid), -1)  # a projected token is readable by the pod's user
        env = {k: v for k, v in env.items() if k not in ("PATH", "HOSTNAME")}  # the image's own
        return ["podman", *containers.podman_argv(pod, env, self.net.netns_name(f"p{pod.metadata.uid[:8]}"),
                                                   image_user, volumes, containers.cgroup_controllers(),
                                                   kubeconfig, str(self.cluster.dir), images.podman_env())]

    def service_account_kubeconfig(self, pod: Any) -> Path:
        """What the kubelet's projected token volume gives a pod, as a kubeconfig."""
        return service_account_kubeconfig(
            self.admin, pod.metadata.namespace, pod.spec.service_account_name or "default",
            self.workdir / pod.metadata.uid / "token" / "kubeconfig", expiration_s=TOKEN_SECONDS,
            server=f"https://{self.relay.address[0]}:{self.relay.address[1]}",
            bound_to={"kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid})

    def launch(self, run: PodRun) -> None:
        if run.container_id is not None:  # one left by a killed podman would hold the name
            images.podman("rm", "--force", "--time", "0", run.container_id, check=False)
        # podman runs with Kiln's containers.conf (runc; see kiln.local.images), and hands the pod's
        # env on from its own (containers.podman_argv); where both have a name, podman's value wins.
        env = {**run.env, **images.podman_env()} if run.container_id is not None else run.env
        run.record = processes.launch(run.argv, run.log_path, env=env)
        run.restart_at, run.failures, run.next_probe = None, 0, 0.0
        run.started, run.live_failures, run.next_live = run.startup is None, 0, 0.0
        log.info("started %s (pid %d) at %s", run.key, run.record["pid"], run.ip)

    # -- readiness and restarts --
    def check(self, run: PodRun) -> None:
        now = time.monotonic()
        if run.record is not None and not processes.alive(run.record):
            code = processes.exit_code(run.record)  # a liveness kill's stop() may have collected it
            tail = processes.log_tail(run.record, 10)
            log.warning("%s exited (%s); restarting in %.0fs\n%s", run.key, code, RESTART_BACKOFF_S, tail)
            code = 128 - code if code is not None and code < 0 else code  # a kubelet's 137 for SIGKILL
            # With FallbackToLogsOnError a kubelet makes the log's end the message of a failed exit.
            run.last_exit = {"exitCode": -1 if code is None else code, "reason": "Completed" if code == 0 else "Error",
                             "message": tail[-2048:] if run.logs_on_error and code != 0 else "",
                             "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            run.record, run.restart_at = None, now + RESTART_BACKOFF_S
            run.restarts += 1
            self.report(run, False)
        if run.record is None:
            if run.restart_at is not None and now >= run.restart_at:
                self.launch(run)
            return
        if not self.live(run, now):
            return
        if run.probe is None:
            self.report(run, True)
            return
        if now < run.next_probe:
            return
        run.next_probe = now + run.probe.period
        if run.probe.check():
            run.failures = 0
            self.report(run, True)
        else:
            run.failures += 1
            # Unready from the start until the first success; afterwards after `failures` misses.
            if run.ready is None or run.failures >= run.probe.failures:
                self.report(run, False)

    def live(self, run: PodRun, now: float) -> bool:
        """The startup probe until it passes, then the liveness probe (container mode only: process
        mode keeps its old behaviour). False once they failed `failureThreshold` times in a row:
        the container is stopped, and restarted as any exited one."""
        probe = run.liveness if run.started else run.startup
        if probe is None or now < run.next_live:
            return True
        run.next_live = now + probe.period
        if probe.check():
            run.started, run.live_failures = True, 0
            return True
        run.live_failures += 1
        if run.live_failures < probe.failures:
            return True
        log.warning("%s failed its %s probe %d times: restarting it", run.key,
                    "liveness" if run.started else "startup", run.live_failures)
        run.next_live = float("inf")  # until the restart's launch()
        threading.Thread(target=self.halt, args=(run, min(run.grace, SHUTDOWN_GRACE_S)), daemon=True).start()
        return False

    def halt(self, run: PodRun, grace: float) -> None:
        """Stop the pod's process (and its container, in container mode)."""
        if run.record is not None:
            processes.stop(run.record, grace=max(grace, 0.1))
        if run.container_id is not None:  # podman killed before its container
            images.podman("rm", "--force", "--time", "0", run.container_id, check=False)

    def wait(self, pod: Any, reason: str, message: str) -> None:
        """Say on the pod why its container does not start (`kubectl describe` shows it, and the
        operator reads the reason), once per distinct message."""
        uid = pod.metadata.uid
        said = self.not_yet.get(uid, (0.0, ""))[1]
        self.not_yet[uid] = (time.monotonic() + NOT_YET_RETRY_S, message)
        if said == message:
            return
        log.warning("%s/%s waits: %s: %s", pod.metadata.namespace, pod.metadata.name, reason, message)
        self.patch_status(pod.metadata.name, pod.metadata.namespace, {"containerStatuses": [
            {"name": pod.spec.containers[0].name, "ready": False, "restartCount": 0,
             "state": {"waiting": {"reason": reason, "message": message}}}]})

    def report(self, run: PodRun, ready: bool) -> None:
        if run.reported == (ready, run.restarts):  # an exit is news even to a pod never ready
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        value = "True" if ready else "False"
        state = {"running": {"startedAt": now}} if run.record else {"waiting": {"reason": "CrashLoopBackOff"}}
        last = {"lastState": {"terminated": run.last_exit}} if run.last_exit else {}
        # Conditions only when readiness changes: their lastTransitionTime means that transition.
        conditions = [{"type": t, "status": value, "lastTransitionTime": now}
                      for t in ("Ready", "ContainersReady")] if run.ready != ready else []
        self.patch_status(run.name, run.namespace, {
            **({"conditions": conditions} if conditions else {}),
            "containerStatuses": [{"name": run.container, "ready": ready, "restartCount": run.restarts,
                                   "state": state, **last}]})
        run.ready, run.reported = ready, (ready, run.restarts)
        log.info("%s ready=%s", run.key, ready)

    def patch_status(self, name: str, namespace: str, status: dict[str, Any]) -> None:
        """Merge into a pod's status; a pod deleted meanwhile has no status left to say."""
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status},
                                                  _content_type="application/strategic-merge-patch+json")
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- stopping --
    def stop_later(self, run: PodRun, grace: float) -> None:
        run.stopping = True
        threading.Thread(target=self.stop, args=(run, grace), name=f"stop {run.key}", daemon=True).start()

    def stop(self, run: PodRun, grace: float, prestop: float | None = None) -> None:
        """preStop sleep (the Endpoints drop the pod meanwhile), SIGTERM, grace, SIGKILL."""
        time.sleep(run.prestop if prestop is None else prestop)
        for attempt in range(STOP_ATTEMPTS):
            try:
                self.halt(run, grace)
                if not self.net.wait_delivered(run.netns):
                    log.warning("%s: TCP data still unacknowledged after exit; deleting its network anyway", run.key)
                self.net.delete_namespace(run.netns)
                break
            except Exception:  # noqa: BLE001 - tried again: a pod left here would stay Terminating
                log.exception("stopping %s failed (attempt %d of %d)", run.key, attempt + 1, STOP_ATTEMPTS)
                time.sleep(NOT_YET_RETRY_S)
        else:  # kept, with its address: forgotten, its namespace could hold the one a replacement gets
            return
        self.pods.pop(run.uid, None)
        log.info("stopped %s", run.key)

    def shutdown(self) -> None:
        # Pods already stopping too: their stop threads may still sleep out a preStop hook and
        # die with this process, which left their processes running after `kiln local down`.
        threads = [threading.Thread(target=self.stop, args=(run, min(run.grace, SHUTDOWN_GRACE_S), 0.0))
                   for run in list(self.pods.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.relay.stop()
        log.info("pod runtime stopped")


def run(directory: Path) -> int:
    """Run pods until SIGTERM; `kiln local up` starts this as one of the cluster's processes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    c = Cluster(directory)
    if not c.state().get("ports"):
        print(f"kiln local runtime: no local cluster in {c.dir}; run `kiln local up` first", file=sys.stderr)
        return 1
    with hold_lock(c):
        runtime = Runtime(c)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: runtime.stopping.set())
        runtime.serve()
    return 0


def hold_lock(c: Cluster) -> IO[str]:
    """<dir>/runtime.lock, held while the returned file is open. A second runtime would take the
    first one's pod namespaces for stale ones and delete them, killing their processes.
    Taken here, in the runtime's own process: the lock goes with it however it ends."""
    lock = open(c.dir / "runtime.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise RuntimeError("a pod runtime already runs for this cluster" + (f" (pid {holder})" if holder else ""))
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
