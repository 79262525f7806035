"""`make up` / `make down`: the whole system on the local cluster.

up: start the local cluster (with its test pod runtime), install Kiln the documented way
(`kubectl apply -k manifests/`), run the operator as a local process with its
ServiceAccount's token (so the manifests' RBAC is what it gets), apply
examples/smollm2.yaml, wait until it is Ready and its router answers, and print a curl.
down: take it all down. The e2e tests (e2e/) drive the same functions.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kubernetes.client.rest import ApiException

from kiln.local import cluster, processes
from kiln.local.kwok import EXTERNAL_READINESS
from kiln.local.testing import api_client, eventually, kubectl, service_account_kubeconfig

REPO = Path(__file__).resolve().parents[3]
OPERATOR = "operator"
EXAMPLE = REPO / "examples" / "smollm2.yaml"


def install(kubeconfig: Path) -> None:
    kubectl(kubeconfig, "apply", "-k", str(REPO / "manifests"))
    kubectl(kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.kiln.dev")


def operator_kubeconfig(c: cluster.Cluster) -> Path:
    """A kubeconfig holding only the kiln-operator ServiceAccount's token."""
    with api_client(c.kubeconfig) as admin:
        return service_account_kubeconfig(admin, "kiln-system", "kiln-operator", c.dir / "pods" / "operator.kubeconfig",
                                          expiration_s=cluster.TOKEN_SECONDS)


def ensure_operator(c: cluster.Cluster) -> dict:
    """Run `kiln operator` for namespace default unless it runs; recorded with the cluster, so `down` stops it.

    Its pods carry the local runtime's opt-in annotation, so the runtime runs them."""
    with c.locked():
        state = c.state()
        record = state["processes"].get(OPERATOR)
        if record and processes.alive(record):
            return record
        env = {"KUBECONFIG": str(operator_kubeconfig(c)), "PATH": "/usr/local/bin:/usr/bin:/bin",
               "HOME": str(Path.home())}
        # Namespace `default` only: test sessions run operators of their own in theirs.
        argv = [sys.executable, "-m", "kiln.cli", "operator", "--interval", "5", "--namespace", "default",
                f"--pod-annotation={EXTERNAL_READINESS}=runtime"]
        record = processes.launch(argv, c.dir / "logs" / f"{OPERATOR}.log", env=env)
        state["processes"][OPERATOR] = record
        c.save(state)
        return record


def router_url(kubeconfig: Path, name: str, namespace: str) -> str | None:
    """http://<router pod IP>:<port>/v1 from the user Service's EndpointSlices, once one is ready.

    The local cluster has no kube-proxy, so Service IPs lead nowhere; pod IPs on the bridge do."""
    out = kubectl(kubeconfig, "get", "endpointslices", "-n", namespace,
                  "-l", f"kubernetes.io/service-name={name}", "-o", "json").stdout
    for item in json.loads(out)["items"]:
        port = next((p["port"] for p in item.get("ports") or [] if p.get("name") == "http"), None)
        for ep in item.get("endpoints") or []:
            if port and (ep.get("conditions") or {}).get("ready"):
                return f"http://{ep['addresses'][0]}:{port}/v1"
    return None


def wait_until_serving(kubeconfig: Path, name: str, namespace: str, timeout: float = 900) -> str:
    """Wait for Ready and a router that knows a ready engine; returns the URL."""
    kubectl(kubeconfig, "wait", "--for=condition=Ready", f"--timeout={int(timeout)}s", "-n", namespace,
            f"inferenceservice/{name}", timeout=timeout + 30)

    def answering() -> str | None:
        url = router_url(kubeconfig, name, namespace)
        if url:
            cluster.urlopen(url.removesuffix("/v1") + "/ready", timeout=5).close()
        return url
    return eventually(answering, f"the router of {namespace}/{name} (Ready) to answer /ready", timeout=120,
                      interval=1, ignore=(OSError,))


def up() -> int:
    c, _ = cluster.up(cluster.default_dir())
    install(c.kubeconfig)
    ensure_operator(c)
    kubectl(c.kubeconfig, "apply", "-f", str(EXAMPLE))
    print("waiting for smollm2 to load and warm up (a minute or two on a CPU)...", flush=True)
    url = wait_until_serving(c.kubeconfig, "smollm2", "default")
    print(kubectl(c.kubeconfig, "get", "isvc").stdout)
    # Greedy: a 135M model sampled at the API's default temperature of 1 rambles.
    body = json.dumps({"model": "smollm2-135m", "max_tokens": 32, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    print(f"Kiln serves smollm2 through its router at {url}\n\n"
          f"  export KUBECONFIG={c.kubeconfig}\n  kubectl get isvc\n"
          f"  curl {url}/chat/completions -H 'Content-Type: application/json' -d '{body}'\n\n"
          "`make down` takes it all down. Note: pods run under kiln.local.runtime, a TEST runtime.")
    return 0


def down(force: bool = False) -> int:
    removed = cluster.down(cluster.default_dir(), force)
    print("local cluster stopped and removed" if removed else "no local cluster to take down")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.local.demo", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--force", action="store_true",
                        help="down even while test sessions use the cluster (`make down FORCE=1`)")
    args = parser.parse_args(argv)
    try:
        return up() if args.action == "up" else down(args.force)
    except KeyboardInterrupt:  # safe to run again: up cleans a half-made cluster, applies are idempotent
        print(f"make {args.action}: interrupted", file=sys.stderr)
        return 130
    # kubectl failed, a wait timed out, a tool (ip, kubectl) missing, the API server refused
    except (RuntimeError, AssertionError, subprocess.TimeoutExpired, OSError, ApiException) as exc:
        print(f"make {args.action}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
