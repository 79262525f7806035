"""`kiln router`: one per InferenceService, in front of its engine pods. Replicas come
from the EndpointSlices of the engine revisions' Services, or from --endpoints for local
use."""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from kiln.listening import listening_sockets
from kiln.router import auth
from kiln.router.endpoints import EndpointSource, StaticEndpoints, parse_endpoints
from kiln.router.proxy import Limits, build_app
from kiln.router.traffic import InferenceServiceTraffic, TrafficSource

log = logging.getLogger("kiln.router")

DEFAULTS = Limits()
# Under Kubernetes' default 30 s grace period: streams still running when the router
# stops are cut by the router, which closes them properly, not by SIGKILL.
SHUTDOWN_SECONDS = 25.0
DEFAULT_PORT_NAME = "http"  # of the Service port the engines listen on: the operator's name for it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # None: every address of both families, so a pod answers its probes on an IPv6 pod IP too.
    parser.add_argument("--host", default=None, help="address to listen on (default: all, IPv4 and IPv6)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", help="fixed replicas, host:port[,host:port...]")
    where.add_argument("--selector", help="label selector of the engine revisions' "
                                          "EndpointSlices, e.g. kiln.dev/inferenceservice=chat,"
                                          "kiln.dev/component=engine")
    parser.add_argument("--namespace", help="with --selector: namespace of the EndpointSlices "
                                            "(default: $POD_NAMESPACE or 'default')")
    parser.add_argument("--inference-service", metavar="NAME",
                        help="with --selector: follow this InferenceService's status for the "
                             "rollout's revision weights and quality-gate mirroring")
    parser.add_argument("--port-name", help="with --selector: name of the Service port the engines "
                                            "listen on ('' if unnamed; default: http)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, "
                                             "else ~/.kube/config)")
    parser.add_argument("--connect-timeout", type=float, default=DEFAULTS.connect_timeout,
                        help="seconds to wait for a replica to accept a connection "
                             "(default: %(default)s)")
    parser.add_argument("--first-byte-timeout", type=float,
                        default=DEFAULTS.first_byte_timeout,
                        help="seconds to wait for a replica's response headers, 0 for no "
                             "limit; a non-streaming request gets them only once its whole "
                             "generation is done (default: %(default)s)")
    parser.add_argument("--stream-idle-timeout", type=float, default=DEFAULTS.stream_idle_timeout,
                        help="seconds a response may go without a byte once it has begun, from the "
                             "replica or to the client, then it is broken off (a replica gone without a "
                             "reset, a client that stopped reading), 0 for no limit "
                             "(default: %(default)s)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULTS.max_in_flight,
                        help="/v1 requests handled at once; more wait in line (--max-queue), then "
                             "get a 429 (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue,
                        help="requests waiting in line, first come first served, for one of "
                             "--max-in-flight; more get a 429 (default: %(default)s: none wait)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes,
                        help="largest request body; larger get a 413 (default: %(default)s)")
    parser.add_argument("--max-body-bytes-in-flight", type=int, default=DEFAULTS.max_body_bytes_in_flight,
                        help="request body bytes held at once, each body until its answer ends; past it a "
                             "429: keep it within the router's memory, with room for what it leaves out (the "
                             "unsent part of a body in a socket's buffer, and up to 4 MiB of bodies the "
                             "quality gate's mirror compares) (default: %(default)s)")
    parser.add_argument("--max-held", type=int, default=DEFAULTS.max_held,
                        help="requests held at once while no replica is ready (scaled to "
                             "zero); more get a 429 (default: %(default)s)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"demand Authorization: Bearer KEY (repeat for more tenants; also "
                             f"${auth.ENV}, one per line); without any, the router is open")
    parser.add_argument("--body-timeout", type=float, default=DEFAULTS.body_timeout,
                        help="seconds to receive a request's body once admitted, then a 408 "
                             "(default: %(default)s)")
    parser.add_argument("--activation-timeout", type=float,
                        default=DEFAULTS.activation_timeout,
                        help="seconds a held request waits for a replica to become ready, "
                             "then gets a 503 (default: %(default)s)")
    parser.add_argument("--prefix-slack", type=int, default=DEFAULTS.prefix_slack,
                        help="prefix affinity: a prompt goes to the replica that served its prefix last "
                             "unless that one has more than this many requests in flight beyond the least "
                             "busy replica; -1 balances on load alone (default: %(default)s)")


def _limits(args: argparse.Namespace) -> Limits:
    """Raises ValueError with a message for the user."""
    if not (math.isfinite(args.connect_timeout) and args.connect_timeout > 0):
        raise ValueError("--connect-timeout must be positive seconds")
    if not (math.isfinite(args.first_byte_timeout) and args.first_byte_timeout >= 0):
        raise ValueError("--first-byte-timeout must be positive seconds, or 0 for no limit")
    if not (math.isfinite(args.stream_idle_timeout) and args.stream_idle_timeout >= 0):
        raise ValueError("--stream-idle-timeout must be positive seconds, or 0 for no limit")
    if args.max_in_flight < 1:
        raise ValueError("--max-in-flight must be at least 1")
    if args.max_queue < 0:
        raise ValueError("--max-queue must be 0 or more")
    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be at least 1")
    if args.max_body_bytes_in_flight < 1:
        raise ValueError("--max-body-bytes-in-flight must be at least 1")
    if args.max_held < 1:
        raise ValueError("--max-held must be at least 1")
    if not (math.isfinite(args.activation_timeout) and args.activation_timeout > 0):
        raise ValueError("--activation-timeout must be positive seconds")
    if not (math.isfinite(args.body_timeout) and args.body_timeout > 0):
        raise ValueError("--body-timeout must be positive seconds")
    if args.prefix_slack < -1:
        raise ValueError("--prefix-slack must be 0 or more, or -1 for no prefix affinity")
    return Limits(connect_timeout=args.connect_timeout, first_byte_timeout=args.first_byte_timeout,
                  stream_idle_timeout=args.stream_idle_timeout,
                  max_in_flight=args.max_in_flight, max_body_bytes=args.max_body_bytes,
                  max_body_bytes_in_flight=args.max_body_bytes_in_flight,
                  max_held=args.max_held, activation_timeout=args.activation_timeout,
                  max_queue=args.max_queue, body_timeout=args.body_timeout, prefix_slack=args.prefix_slack)


def _sources(args: argparse.Namespace) -> tuple[EndpointSource, TrafficSource | None]:
    """Where the replicas are, and the rollout's split if followed. Raises ValueError with a
    message for the user."""
    if args.endpoints is not None:
        if args.inference_service is not None:
            raise ValueError("--inference-service needs --selector (a cluster), not --endpoints")
        for flag in ("kubeconfig", "namespace", "port_name"):  # each would be ignored: no cluster is read
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --selector (a cluster), not --endpoints")
        try:
            return StaticEndpoints(parse_endpoints(args.endpoints)), None
        except ValueError as exc:
            raise ValueError(f"--endpoints: {exc}") from None
    if not args.selector.strip():
        raise ValueError("--selector must not be empty: it would take every EndpointSlice "
                         "in the namespace")
    # Imported here: the static mode should not need a cluster client at all.
    from kubernetes import client, config

    from kiln.router.endpointslices import EndpointSliceSource

    configuration = client.Configuration()
    if args.kubeconfig is not None and not os.path.exists(args.kubeconfig):
        raise ValueError(f"--kubeconfig {args.kubeconfig}: no such file")
    try:
        if args.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=args.kubeconfig,
                                    client_configuration=configuration)
    except config.ConfigException as exc:
        raise ValueError(f"cannot load Kubernetes config: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a file that is no YAML, or no mapping
        where = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise ValueError(f"{where} is not a kubeconfig "
                         f"({type(exc).__name__}: {exc})") from None
    api = client.ApiClient(configuration)
    namespace = args.namespace or os.environ.get("POD_NAMESPACE", "default")
    traffic = None if args.inference_service is None else \
        InferenceServiceTraffic(api, namespace, args.inference_service)
    port_name = DEFAULT_PORT_NAME if args.port_name is None else args.port_name
    return EndpointSliceSource(api, namespace, args.selector, port_name), traffic


@asynccontextmanager
async def serving(app: web.Application, host: str | None, port: int) -> AsyncIterator[int]:
    """Serves `app` while the block runs and gives the port it listens on. `kiln router`
    and the tests both start the router here, so they run it alike."""
    # handler_cancellation: a client that hangs up cancels its handler, which drops the
    # upstream request, so the engine stops generating for nobody (streaming or not).
    # aiohttp waits its shutdown_timeout twice for a handler still running (once for it to end,
    # once more after cancelling its request's body, which a relaying stream no longer reads)
    # before it cancels the handler: half each, so streams are cut within SHUTDOWN_SECONDS.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_SECONDS / 2)
    await runner.setup()
    try:
        for sock in listening_sockets(host, port):
            await web.SockSite(runner, sock).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _serve_until_stopped(app: web.Application, host: str | None, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serving(app, host, port) as bound:
        log.info("listening on %s:%d", host or "*", bound)
        await stop.wait()
    log.info("stopped")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        print(f"kiln router: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    try:
        limits = _limits(args)
        api_keys = auth.api_keys(args.api_key)
        source, traffic = _sources(args)
    except ValueError as exc:
        print(f"kiln router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if api_keys is None:
        log.warning("no API key: anyone who reaches the router can use the model")
    try:
        asyncio.run(_serve_until_stopped(build_app(source, limits, traffic, api_keys), args.host, args.port))
    except OSError as exc:  # the port is taken or the address is not this machine's
        print(f"kiln router: cannot listen on {args.host or '*'}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
