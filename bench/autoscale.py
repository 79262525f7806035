"""Autoscaling on the local cluster: how fast new replicas serve after a load step, and a cold
start from zero cut into its parts. The baseline the warm-pool work has to beat.

Real parts: the local control plane, the operator (builtin autoscaler, 2 s tick; 0.5 s at zero), engines and
routers as processes under the test pod runtime, SmolLM2-135M in float32 on this CPU. No peer
runs beside it: KServe, KubeAI and llm-d cannot be installed here (no images, no registry), so
this records Kiln's own figures only.

Cold start phases are seen from outside by polling every 50 ms: the request is sent (and held
by the router) -> the engine pod exists -> it is scheduled -> its process answers /health
(started, imports done) -> kiln:model_load_seconds is set (weights loaded) -> /ready (warm-up
done) -> the first byte reaches the client.

    .venv/bin/python bench/autoscale.py          # writes bench/results/autoscale-<date>-<cpu kind>.json

On a failure the operator's log and the pods' logs are kept in a folder under the system's temp
directory (its path printed), never among the results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import openai
import yaml

from cpu_common import REPO, machine, write_result
from kiln.local import cluster, demo
from kiln.local.kwok import EXTERNAL_READINESS
from kiln.local.testing import OperatorProcess, eventually, kubectl

POLL_S = 0.05


def get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.read().decode()
    except OSError:
        return None


def model_load_seconds(page: str | None) -> float:
    """The engine's kiln:model_load_seconds (0 until the weights are in)."""
    from prometheus_client.parser import text_string_to_metric_families
    if not page:
        return 0.0
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == "kiln:model_load_seconds")


class Service:
    def __init__(self, kubeconfig: Path, namespace: str, name: str, autoscaling: dict,
                 warm_pool: dict | None = None) -> None:
        self.kubeconfig, self.namespace, self.name = kubeconfig, namespace, name
        body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
        body["metadata"]["name"] = name
        if warm_pool:
            body["spec"]["warmPool"] = warm_pool
        body["spec"]["autoscaling"] = {"mode": "builtin", "stableWindow": "10s", "panicWindow": "4s", **autoscaling}
        kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
        self.url = demo.wait_until_serving(kubeconfig, name, namespace).removesuffix("/v1")

    def get(self, *args: str) -> dict:
        return json.loads(kubectl(self.kubeconfig, "get", "-n", self.namespace, "-o", "json", *args).stdout)

    def engine_pods(self) -> list[dict]:
        return self.get("pods", "-l", f"kiln.dev/inferenceservice={self.name},kiln.dev/component=engine")["items"]

    def status(self) -> dict:
        return self.get("isvc", self.name).get("status") or {}


def timed_request(svc: Service, checks: Callable[[], dict[str, bool]]) -> dict[str, float]:
    """Sends one streamed request and polls `checks` until its first byte; the seconds from the
    send at which each check first held, and `first_byte`."""
    api = openai.OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=900)
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    first_byte = threading.Event()

    failure: list[Exception] = []

    def request() -> None:
        try:
            for _ in api.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=8, stream=True):
                if not first_byte.is_set():
                    marks["first_byte"] = time.monotonic() - t0
                    first_byte.set()
        except openai.APIError as exc:
            failure.append(exc)
            first_byte.set()
    sender = threading.Thread(target=request)
    sender.start()
    while not first_byte.is_set():
        for mark, seen in checks().items():
            if seen and mark not in marks:
                marks[mark] = time.monotonic() - t0
        time.sleep(POLL_S)
    sender.join()
    if failure:
        raise RuntimeError(f"the timed request failed: {failure[0]!r}")
    return marks


def phases(marks: dict[str, float], order: list[str]) -> dict:
    timeline = {m: round(marks[m], 2) for m in order if m in marks}
    steps, before = {}, 0.0
    for m, at in timeline.items():
        steps[m] = round(at - before, 2)
        before = at
    return {"timeline_s": timeline, "phase_s": steps}


def cold_start(svc: Service) -> dict:
    eventually(lambda: not svc.engine_pods() and svc.status().get("desiredReplicas") == 0, "scale to zero",
               timeout=300, interval=1)

    def checks() -> dict[str, bool]:
        pods = svc.engine_pods()
        pod = pods[0] if pods else None
        ip = (pod or {}).get("status", {}).get("podIP")
        return {"pod_created": pod is not None, "scheduled": bool(pod and pod["spec"].get("nodeName")),
                "process_up": bool(ip and get(f"http://{ip}:8000/health")),
                "weights_loaded": bool(ip and model_load_seconds(get(f"http://{ip}:8000/metrics"))),
                "ready": bool(ip and get(f"http://{ip}:8000/ready"))}
    marks = timed_request(svc, checks)
    return {**phases(marks, ["pod_created", "scheduled", "process_up", "weights_loaded", "ready", "first_byte"]),
            "status_lastColdStartSeconds": svc.status().get("autoscaling", {}).get("lastColdStartSeconds")}


def engine_gauge(pod: dict, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families
    page = get(f"http://{pod['status']['podIP']}:8000/metrics")
    found = [s.value for f in text_string_to_metric_families(page or "") for s in f.samples if s.name == name]
    return found[0] if found else None


def warm_start(svc: Service, asleep: bool) -> dict:
    """From zero serving replicas with one standby in the pool (asleep or not): held, promoted
    (and woken), answered. Also the standby's resident memory while it waited."""
    def standbys_only() -> dict | None:
        pods = [p for p in svc.engine_pods() if not p["metadata"].get("deletionTimestamp")]
        if svc.status().get("desiredReplicas") != 0 or len(pods) != 1 or svc.status().get("warmReplicas") != 1:
            return None
        return pods[0] if engine_gauge(pods[0], "kiln:engine_sleep_state") == int(asleep) else None
    standby = eventually(standbys_only, "zero serving, one standby", timeout=300, interval=1)
    rss = engine_gauge(standby, "process_resident_memory_bytes")

    def checks() -> dict[str, bool]:
        return {"promoted": any(p["metadata"]["labels"].get("kiln.dev/serving") == "true" for p in svc.engine_pods())}
    return {**phases(timed_request(svc, checks), ["promoted", "first_byte"]),
            "standby_rss_mib": round(rss / 2**20) if rss else None}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def load_step(svc: Service, clients: int) -> dict:
    api = openai.OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    stop, failures = threading.Event(), []

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                for _ in api.completions.create(model="smollm2-135m", prompt=f"Story {i}:", max_tokens=64,
                                                stream=True):
                    pass
            except openai.APIError as exc:
                failures.append(repr(exc))
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    marks: dict[str, float] = {}
    try:
        while "ready_3" not in marks and time.monotonic() - t0 < 900:
            status = svc.status()
            for n in (2, 3):
                if status.get("desiredReplicas", 0) >= n and f"decided_{n}" not in marks:
                    marks[f"decided_{n}"] = round(time.monotonic() - t0, 2)
                if status.get("readyReplicas", 0) >= n and f"ready_{n}" not in marks:
                    marks[f"ready_{n}"] = round(time.monotonic() - t0, 2)
            time.sleep(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return {"clients": clients, "seconds_from_step": marks, "failed_requests": len(failures)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="cold and warm starts from zero, each")
    parser.add_argument("--no-load-step", action="store_true", help="only the starts from zero")
    args = parser.parse_args()
    c, _ = cluster.up(cluster.default_dir(), user=os.getpid())
    demo.install(c.kubeconfig)
    namespace = f"kiln-bench-{uuid.uuid4().hex[:6]}"
    kubectl(c.kubeconfig, "create", "namespace", namespace)
    eventually(lambda: kubectl(c.kubeconfig, "get", "sa", "default", "-n", namespace, check=False).returncode == 0,
               "the namespace's ServiceAccount", timeout=60)
    logs = Path(tempfile.mkdtemp(prefix=f"{namespace}-"))  # kept on a failure, never in bench/results
    log = logs / "operator.log"
    operator = OperatorProcess(demo.operator_kubeconfig(c), log, ("-n", namespace,
                                                                 f"--pod-annotation={EXTERNAL_READINESS}=runtime"))
    operator.start(interval=5)
    zero = {"minReplicas": 0, "maxReplicas": 1, "scaleDownDelay": "10s"}
    try:
        step = None
        if not args.no_load_step:
            step = load_step(Service(c.kubeconfig, namespace, "step", {"minReplicas": 1, "maxReplicas": 3,
                                                                         "targetQueueDepth": 2,
                                                                         "scaleDownDelay": "30s"}), clients=8)
            kubectl(c.kubeconfig, "delete", "isvc", "step", "-n", namespace)
        cold_svc = Service(c.kubeconfig, namespace, "cold", zero)
        colds = []
        for i in range(args.repeats):
            colds.append(cold_start(cold_svc))
            print(f"cold start {i + 1}: {colds[-1]['timeline_s']}", flush=True)
        kubectl(c.kubeconfig, "delete", "isvc", "cold", "-n", namespace)
        warms: dict[str, list[dict]] = {}
        for sleep in (False, True):
            label = "asleep" if sleep else "awake"
            warm_svc = Service(c.kubeconfig, namespace, f"warm-{label}", zero, warm_pool={"size": 1, "sleep": sleep})
            warms[label] = []
            for i in range(args.repeats):
                warms[label].append(warm_start(warm_svc, sleep))
                print(f"warm start {i + 1}, standby {label}: {warms[label][-1]}", flush=True)
            kubectl(c.kubeconfig, "delete", "isvc", warm_svc.name, "-n", namespace)
    except BaseException:
        for pod_log in (c.dir / "logs" / "pods").glob(f"{namespace}_*.log"):
            shutil.copy(pod_log, logs)
        print(f"failed; the operator's and the pods' logs: {logs}")
        raise
    else:
        shutil.rmtree(logs, ignore_errors=True)
    finally:
        operator.stop()
        kubectl(c.kubeconfig, "delete", "namespace", namespace, "--wait=false", check=False)
        cluster.leave(c, os.getpid())
    cold_s = median([r["timeline_s"]["first_byte"] for r in colds])
    warm_s = {label: median([r["timeline_s"]["first_byte"] for r in runs]) for label, runs in warms.items()}
    rss = {label: median([r["standby_rss_mib"] for r in runs if r["standby_rss_mib"]]) for label, runs in warms.items()}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "load_step": step, "cold_start_from_zero": colds, "warm_start_from_zero": warms,
              "median_first_byte_s": {"cold": cold_s, **{f"warm_{k}": v for k, v in warm_s.items()}},
              "median_standby_rss_mib": rss,
              "note": "local cluster, CPU engines (SmolLM2-135M float32), test pod runtime; from a request sent "
                      "at zero serving replicas to its first byte; warm: one standby in the pool, promoted on the "
                      "builtin autoscaler's next tick (0.5 s at zero), woken first when asleep; no peer can run here"}
    print(json.dumps(result, indent=1))
    if step:
        print(f"load step to 3 replicas serving: {step['seconds_from_step'].get('ready_3')} s")
    print(f"from zero to first byte, median of {args.repeats}: cold start {cold_s} s, warm pool "
          f"{warm_s['awake']} s with the standby awake ({rss['awake']} MiB resident), {warm_s['asleep']} s asleep "
          f"({rss['asleep']} MiB; cold x{cold_s / warm_s['asleep']:.1f}); cold phases (last run): "
          f"{', '.join(f'{k} {v}s' for k, v in colds[-1]['phase_s'].items())}")
    print(f"wrote {write_result('autoscale', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
