"""`kiln local build|up|down|status`: the local Kubernetes control plane."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.local import build, cluster, processes

DEFAULT_JOBS = 2
# The options each action reads: one given to another action is refused, not silently ignored.
OPTIONS = {"build": {"jobs"}, "up": {"dir", "bridge", "subnet", "jobs"}, "down": {"dir", "force"},
           "status": {"dir"}, "runtime": {"dir"}, "images": {"image", "torch", "rebuild"}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("build", "up", "down", "status", "runtime", "images"),
                        help="runtime: run the test pod runtime in the foreground (`up` starts it); "
                             "images: build the engine and operator images with podman (`make images`)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="state directory (default $KILN_LOCAL_DIR or ~/.cache/kiln/local)")
    # None when not given: a cluster already up keeps its own, and only an explicit other one is refused.
    parser.add_argument("--bridge", default=None,
                        help=f"bridge device for pod addresses ($KILN_LOCAL_BRIDGE, else {cluster.DEFAULT_BRIDGE})")
    parser.add_argument("--subnet", default=None,
                        help=f"pod address range, IPv4 /16 to /28 ($KILN_LOCAL_SUBNET, else {cluster.DEFAULT_SUBNET})")
    parser.add_argument("--force", action="store_true", help="down even while test sessions use the cluster")
    # None when not given, so that giving it to an action that builds nothing can be refused.
    parser.add_argument("--jobs", type=jobs, default=None,
                        help=f"build, up: parallel Go compile jobs (default {DEFAULT_JOBS})")
    parser.add_argument("--image", action="append", choices=("engine", "operator"),
                        help="images: build only this one (repeatable; default both)")
    parser.add_argument("--torch", default=None,
                        help="images: the engine's torch requirement, e.g. 'torch --index-url URL' "
                             "(default: PyPI's torch, CUDA libraries included)")
    parser.add_argument("--rebuild", action="store_true", help="images: build even when cached")


def run(args: argparse.Namespace) -> int:
    ignored = sorted(f"--{name}" for name, value in vars(args).items()
                     if name != "action" and value not in (None, False) and name not in OPTIONS[args.action])
    if ignored:
        print(f"kiln local {args.action} takes no {', '.join(ignored)}", file=sys.stderr)
        return 2
    directory = args.dir or cluster.default_dir()
    compile_jobs = args.jobs or DEFAULT_JOBS
    try:
        if args.action == "build":
            built = build.ensure_built(jobs=compile_jobs)
            print("built: " + (", ".join(f"{m} in {s:.0f}s" for m, s in built.items()) or "nothing (cached)"))
            for target in build.TARGETS:
                print(f"{target.module} {target.version}: {build.bin_dir(target)}")
        elif args.action == "up":
            bridge, subnet = args.bridge or cluster.DEFAULT_BRIDGE, args.subnet or cluster.DEFAULT_SUBNET
            # Usage errors: exit 2. A cluster up on another network would be kept as it is, silently.
            problem = cluster.check_network(bridge, subnet) or cluster.Cluster(directory).other_network(
                args.bridge, args.subnet)
            if problem:
                print(f"kiln local up: {problem}", file=sys.stderr)
                return 2
            c, started = cluster.up(directory, bridge, subnet, jobs=compile_jobs)
            print(("started" if started else "already up") + f": {c.server()}")
            print(f"export KUBECONFIG={c.kubeconfig}")
        elif args.action == "down":
            removed = cluster.down(directory, args.force)
            print("stopped and removed" if removed else f"no local cluster in {directory}")
        elif args.action == "images":
            from kiln.local import images
            return images.run(tuple(args.image or ("engine", "operator")), args.torch, args.rebuild)
        elif args.action == "runtime":
            from kiln.local import runtime  # needs the kubernetes client; the rest does not
            return runtime.run(directory)
        else:
            return show_status(cluster.Cluster(directory))
    except (RuntimeError, OSError) as exc:  # OSError: --dir a file, a folder not writable
        print(f"kiln local {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def jobs(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def show_status(c: cluster.Cluster) -> int:
    state = c.state()
    if not state:
        print(f"no local cluster in {c.dir}")
        return 3
    for name, record in state.get("processes", {}).items():
        print(f"{name:<24} pid {record['pid']:<8} {'running' if processes.alive(record) else 'STOPPED'}")
    net = c.network(state)
    print(f"apiserver {c.server()}  kubeconfig {c.kubeconfig}")
    namespaces = ", ".join(net.namespaces()) or "-"
    print(f"network {net.bridge} {net.subnet} gateway {net.gateway}  namespaces: {namespaces}")
    return 0 if c.is_up() else 1
