"""`kiln operator`: wire the reconcile loop to kopf's watches and run it.

kopf only delivers watch events here: InferenceServices and the Deployments, pods and
Services that carry an InferenceService's label. Each event wakes that InferenceService's one
reconcile loop (controller.py); --interval is a slow resync as a safety net."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import functools
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import kopf
import kubernetes

from kiln.listening import listening_sockets

from . import endpoints, leader, placement
from .controller import Controller
from .models import GROUP, OBJECT_NAME, PLURAL, VERSION
from .api import Api
from .reconcile import DEFAULT_PROMETHEUS, Settings, forget, reconcile
from .render import LABEL_ISVC, engine_image

CHILDREN = [("apps", "v1", "deployments"), ("", "v1", "pods"), ("", "v1", "services"),
            ("autoscaling", "v2", "horizontalpodautoscalers"), ("networking.k8s.io", "v1", "networkpolicies")]


def build_registry(api: Api, settings: Settings, elector: leader.LeaseElector | None = None,
                   on_lost: Callable[[str], None] = lambda why: None,
                   on_stopped: Callable[[], None] = lambda: None) -> kopf.OperatorRegistry:
    """kopf's handlers; with `elector`, reconcile passes run only while this replica holds the
    Lease, and `on_lost(why)` is called if it stops holding it or the API server refuses it. `on_stopped` is called last when the
    operator stops."""
    registry = kopf.OperatorRegistry()
    leading = leader.Leadership() if elector else None
    if leading is not None:  # a pass that outlives the Lease stops before its next write
        api = dataclasses.replace(api, fence=leading.check)
    controller = Controller(functools.partial(reconcile, api, settings=settings), leading=leading,
                            on_gone=functools.partial(forget, settings))
    election: list[asyncio.Task] = []

    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    async def elect(**_: Any) -> None:
        election.append(asyncio.create_task(leader.campaign(elector, leading, on_lost)))

    async def stop(**_: Any) -> None:
        await controller.stop()  # the Lease renewed meanwhile: passes finish their writes as leader
        for task in election:
            task.cancel()
        await asyncio.gather(*election, return_exceptions=True)
        if elector is not None and leading.held():
            try:
                await asyncio.to_thread(elector.release)
            except Exception as err:  # noqa: BLE001 - the Lease then expires on its own
                logging.getLogger("kiln.operator").warning("leader election: release failed: %s", err)
        on_stopped()

    async def on_service(event: kopf.RawEvent, namespace: str, name: str, meta: kopf.Meta, **_: Any) -> None:
        key = (namespace, name)
        if event["type"] == "DELETED":
            # kopf handles each uid's events in its own task: a namesake made again may be seen
            # first, and its loop must not end. A pass reads which one is there.
            if settings.uids.get(key, meta.get("uid")) == meta.get("uid"):
                controller.forget(key)
            else:
                controller.trigger(key)
        else:
            settings.uids[key] = meta.get("uid")
            if settings.own_writes.get(key) != meta.get("resourceVersion"):  # not our status write
                controller.trigger(key)

    async def on_child(labels: kopf.Labels, namespace: str, **_: Any) -> None:
        controller.trigger((namespace, labels[LABEL_ISVC]))

    kopf.on.login(registry=registry, id="login")(login)
    kopf.on.cleanup(registry=registry, id="stop")(stop)
    if elector is not None:
        kopf.on.startup(registry=registry, id="leader-election")(elect)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="inferenceservice")(on_service)
    for group, version, plural in CHILDREN:
        kopf.on.event(group, version, plural, registry=registry, id=f"child-{plural}",
                      labels={LABEL_ISVC: kopf.PRESENT})(on_child)
    return registry


class QuietEvents(logging.Filter):
    """kopf logs every event handler's success; every pod update is not news."""
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or "succeeded" not in record.getMessage()


def build_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # kopf's bookkeeping goes to kiln.dev annotations, never into our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # No handler needs a finalizer now, so kopf removes this one from objects an older
    # operator version marked: deleting an InferenceService never waits for the operator.
    settings.persistence.finalizer = f"{GROUP}/operator"
    # Our own Events say what changed; kopf's "handler succeeded" would drown them.
    settings.posting.level = logging.WARNING
    # Only our children, selected by the API server: the handlers' label filter runs in this
    # process, which listed and watched every pod and Deployment of the cluster (in one unpaged list).
    for group, version, plural in CHILDREN:
        settings.watching.label_selectors[group, version, plural] = LABEL_ISVC
    settings.watching.chunk_size = 500
    return settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--interval", type=float, default=300.0,
                        help="seconds between safety-net resync passes over each InferenceService; "
                             "changes to it or its children wake it at once (default 300)")
    parser.add_argument("--engine-image", default=engine_image(),
                        help="engine container image (default: $KILN_ENGINE_IMAGE or %(default)s)")
    parser.add_argument("--pod-annotation", action="append", default=[], metavar="KEY=VALUE",
                        help="annotation for every pod the operator makes (repeatable), e.g. "
                             "kiln.dev/readiness=runtime for the local test runtime")
    parser.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS,
                        help="Prometheus that KEDA ScaledObjects query (autoscaling.mode keda; "
                             "default %(default)s)")
    parser.add_argument("--liveness", metavar="URL",
                        help="serve a liveness endpoint, e.g. http://:8080/healthz (no host: every address, "
                             "IPv4 and IPv6)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve the operator's Prometheus metrics on this port, every address (default: off)")
    for kind, which in (("gpu", "that ask for GPUs"), ("cpu", "that run on CPU (gpus: 0) and for router pods")):
        parser.add_argument(f"--{kind}-node-selector", action="append", default=[], metavar="KEY=VALUE",
                            help=f"node label for engine pods {which} (repeatable); a service's own "
                                 "nodeSelector wins per key")
        parser.add_argument(f"--{kind}-toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                            help=f"taint tolerated by engine pods {which} (repeatable), e.g. "
                                 "nvidia.com/gpu:NoSchedule; added to a service's own")
    parser.add_argument("--leader-elect", action="store_true",
                        help="one of several replicas: only the holder of the Lease reconciles; "
                             f"another takes over within {leader.HANDOVER_S:g} s of its death")
    parser.add_argument("--lease-name", default="kiln-operator", help="the Lease (default: %(default)s)")
    parser.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "kiln-system"),
                        help="the Lease's namespace (default: $POD_NAMESPACE or kiln-system)")
    parser.add_argument("--verbose", "-v", action="store_true")


def placements(args: argparse.Namespace) -> placement.Placements:
    """Raises ValueError with a message for the user."""
    def one(kind: str) -> placement.Placement:
        labels = getattr(args, f"{kind}_node_selector")
        taints = getattr(args, f"{kind}_toleration")
        return placement.Placement(
            dict(placement.parse_label(text, f"--{kind}-node-selector") for text in labels),
            tuple(placement.parse_toleration(text, f"--{kind}-toleration") for text in taints))
    return placement.Placements(gpu=one("gpu"), cpu=one("cpu"))


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a namespace's name


def check_lease(args: argparse.Namespace) -> None:
    """--lease-name and --lease-namespace as the API server takes them: a typo is said now, not
    as the API server's refusal once running."""
    if not args.leader_elect:
        return
    if not (len(args.lease_name) <= 253 and re.match(OBJECT_NAME, args.lease_name)):
        raise ValueError(f"--lease-name {args.lease_name!r} is not a Kubernetes object name (lowercase letters, "
                         "digits, '-' and '.', at most 253)")
    if not DNS_LABEL.match(args.lease_namespace):
        raise ValueError(f"--lease-namespace {args.lease_namespace!r} is not a namespace name (lowercase letters, "
                         "digits and '-', at most 63)")


def check_targets(args: argparse.Namespace) -> None:
    """--namespace, --engine-image and --prometheus-url as a cluster takes them: a typo is said
    now, not as every object's failure once running."""
    for namespace in args.namespace:
        if not DNS_LABEL.match(namespace):
            raise ValueError(f"--namespace {namespace!r} is not a namespace name (lowercase letters, digits and "
                             "'-', at most 63)")
    if not args.engine_image or any(c.isspace() for c in args.engine_image):
        raise ValueError(f"--engine-image {args.engine_image!r} is not an image reference")
    url = urllib.parse.urlsplit(args.prometheus_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"--prometheus-url takes http(s)://HOST[:PORT], e.g. {DEFAULT_PROMETHEUS}, "
                         f"got {args.prometheus_url!r}")


async def operate(listeners: endpoints.Listeners, **kopf_args: Any) -> None:
    """kopf's operator with our endpoints on its event loop (what kopf.run does, plus those)."""
    async with endpoints.serving(listeners):
        try:
            await kopf.operator(**kopf_args)
        except asyncio.CancelledError:  # as kopf.run: a cancelled operator has stopped
            pass


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.interval) and args.interval > 0):  # nan compares False with everything
        print("kiln operator: --interval must be positive", file=sys.stderr)
        return 2
    pairs = [a.partition("=") for a in args.pod_annotation]
    if any(not key or not sep for key, sep, _ in pairs):
        print("kiln operator: --pod-annotation takes KEY=VALUE", file=sys.stderr)
        return 2
    try:  # before connecting: every later failure of these would be the API server's, per object
        pod_annotations = {placement.check_key(key, "--pod-annotation"): value for key, _, value in pairs}
        where = placements(args)
        liveness = endpoints.parse_liveness(args.liveness) if args.liveness else None
        check_lease(args)
        check_targets(args)
    except ValueError as err:
        print(f"kiln operator: {err}", file=sys.stderr)
        return 2
    if not 0 <= args.metrics_port < 65536:
        print(f"kiln operator: --metrics-port {args.metrics_port} is not a port number", file=sys.stderr)
        return 2
    listeners = endpoints.Listeners()
    try:  # a port taken: one line, as `kiln serve` says it
        what = f"liveness on {args.liveness}"
        if liveness is not None:
            listeners.liveness, listeners.liveness_path = listening_sockets(liveness.host, liveness.port), liveness.path
        what = f"metrics on port {args.metrics_port}"
        if args.metrics_port:
            listeners.metrics = listening_sockets(None, args.metrics_port)
    except OSError as err:
        print(f"kiln operator: cannot serve {what}: {err.strerror or err}", file=sys.stderr)
        return 1
    kopf.configure(verbose=args.verbose)
    logging.getLogger("kopf.objects").addFilter(QuietEvents())
    try:
        api = Api.connect()
    except kubernetes.config.ConfigException as err:
        given = f"KUBECONFIG={os.environ['KUBECONFIG']}: " if os.environ.get("KUBECONFIG") else ""
        print(f"kiln operator: no cluster to talk to ({given}{err}); set KUBECONFIG or run in a pod",
              file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - a kubeconfig that is no YAML, a folder, no mapping
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        print(f"kiln operator: cannot read the kubeconfig {where}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    # standalone: no kopf peering (it needs its own CRDs); replicas elect a leader on a Lease.
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints every thread's stack: for a stuck pass
    settings = Settings(args.engine_image, pod_annotations, args.interval, args.prometheus_url, placements=where)
    # kopf stops when this is set (an asyncio.Event: it waits on a threading.Event in a thread that
    # would outlive its loop). A lost Lease sets it; so does the cleanup after a signal, as kopf
    # otherwise waits 5 s for the task that watches it before it cancels that task.
    stop_flag, lost = asyncio.Event(), threading.Event()
    why_lost: list[str] = []

    def on_lost(why: str) -> None:
        why_lost.append(why)
        lost.set()
        stop_flag.set()

    elector = None
    if args.leader_elect:
        elector = leader.LeaseElector(kubernetes.client.CoordinationV1Api(api.client), args.lease_namespace,
                                      args.lease_name, f"{socket.gethostname()}-{os.getpid()}")
    asyncio.run(operate(listeners, registry=build_registry(api, settings, elector, on_lost, stop_flag.set),
                        stop_flag=stop_flag, settings=build_settings(), standalone=True,
                        clusterwide=not args.namespace, namespaces=args.namespace))
    if lost.is_set():
        print(f"kiln operator: {why_lost[0]}", file=sys.stderr)
        return 1
    return 0
