"""`kiln operator`: wire reconcile() to kopf and run it.

Every trigger calls the same reconcile: create/update/resume for a quick reaction, and a
timer so the cluster keeps converging (deleted or edited children come back) without
watching every child kind."""
from __future__ import annotations

import argparse
import collections
import logging
import sys
import threading
from typing import Any

import kopf
import kubernetes

from .desired import engine_image
from .models import GROUP, PLURAL, VERSION
from .reconcile import Api, reconcile


def build_registry(api: Api, image: str, interval: float,
                   pod_annotations: dict[str, str] | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    # Triggers can overlap (an update while the timer runs); one pass per object at a time.
    locks: collections.defaultdict[str, threading.Lock] = collections.defaultdict(threading.Lock)

    def handle(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        with locks[body["metadata"]["uid"]]:
            reconcile(body, api, image, logger, pod_annotations)

    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    kopf.on.login(registry=registry, id="login")(login)
    retry = {"registry": registry, "backoff": min(interval, 10.0)}
    kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-create", **retry)(handle)
    kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile-update", field="spec", **retry)(handle)
    kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-resume", **retry)(handle)
    kopf.timer(GROUP, VERSION, PLURAL, id="resync", interval=interval, **retry)(handle)
    return registry


class QuietResync(logging.Filter):
    """A resync that found nothing to do every few seconds is not news; its failures are."""
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or "Timer 'resync' succeeded" not in record.getMessage()


def build_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # kopf's bookkeeping goes to kiln.dev annotations, never into our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # kopf timers need a finalizer (to stop before the object goes); name it after us.
    settings.persistence.finalizer = f"{GROUP}/operator"
    # Our own Events (kopf.event) say what changed; kopf's "handler succeeded" would drown them.
    settings.posting.level = logging.WARNING
    return settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--interval", type=float, default=30.0,
                        help="seconds between resync passes over each InferenceService (default 30)")
    parser.add_argument("--engine-image", default=engine_image(),
                        help="engine container image (default: $KILN_ENGINE_IMAGE or %(default)s)")
    parser.add_argument("--pod-annotation", action="append", default=[], metavar="KEY=VALUE",
                        help="annotation for every pod the operator makes (repeatable), e.g. "
                             "kiln.dev/readiness=runtime for the local test runtime")
    parser.add_argument("--liveness", metavar="URL",
                        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", "-v", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("kiln operator: --interval must be positive", file=sys.stderr)
        return 2
    pairs = [a.partition("=") for a in args.pod_annotation]
    if any(not key or not sep for key, sep, _ in pairs):
        print("kiln operator: --pod-annotation takes KEY=VALUE", file=sys.stderr)
        return 2
    pod_annotations = {key: value for key, _, value in pairs}
    kopf.configure(verbose=args.verbose)
    logging.getLogger("kopf.objects").addFilter(QuietResync())
    try:
        api = Api.connect()
    except kubernetes.config.ConfigException as err:
        print(f"kiln operator: no cluster to talk to ({err}); set KUBECONFIG or run in a pod",
              file=sys.stderr)
        return 1
    # standalone: one replica (Recreate), so no peering objects and no RBAC for them.
    kopf.run(registry=build_registry(api, args.engine_image, args.interval, pod_annotations),
             settings=build_settings(), standalone=True, clusterwide=not args.namespace,
             namespaces=args.namespace, liveness_endpoint=args.liveness)
    return 0
