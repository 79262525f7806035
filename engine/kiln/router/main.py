"""`kiln router`: one per InferenceService, in front of its engine pods. Replicas come
from the Service's EndpointSlices, or from --endpoints for local use."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web

from kiln.router.endpoints import EndpointSource, StaticEndpoints, parse_endpoints
from kiln.router.proxy import build_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", help="fixed replicas, host:port[,host:port...]")
    where.add_argument("--service", help="Kubernetes Service whose EndpointSlices list "
                                         "the engine pods")
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                        help="namespace of --service (default: $POD_NAMESPACE or 'default')")
    parser.add_argument("--port-name", default="http",
                        help="name of the Service port the engines listen on ('' if unnamed)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, "
                                             "else ~/.kube/config)")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to wait for a replica to accept a connection")


def _endpoint_source(args: argparse.Namespace) -> EndpointSource:
    """Raises ValueError with a message for the user."""
    if args.endpoints is not None:
        try:
            return StaticEndpoints(parse_endpoints(args.endpoints))
        except ValueError as exc:
            raise ValueError(f"--endpoints: {exc}") from None
    # Imported here: the static mode should not need a cluster client at all.
    from kubernetes import client, config

    from kiln.router.endpointslices import EndpointSliceSource

    configuration = client.Configuration()
    try:
        if args.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=args.kubeconfig,
                                    client_configuration=configuration)
    except Exception as exc:  # noqa: BLE001 - ConfigException, missing or broken files
        raise ValueError(f"cannot load Kubernetes config: {exc}") from None
    return EndpointSliceSource(client.ApiClient(configuration), args.namespace, args.service,
                               args.port_name)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        print(f"kiln router: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    if args.connect_timeout <= 0:
        print("kiln router: --connect-timeout must be positive", file=sys.stderr)
        return 2
    try:
        source = _endpoint_source(args)
    except ValueError as exc:
        print(f"kiln router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(build_app(source, args.connect_timeout), host=args.host, port=args.port,
                access_log=None)
    return 0
