"""`kiln operator`'s warm pool against the real local control plane, with kwok for kubelets: a
standby beside each serving replica, out of the revision's EndpointSlices; scaling up promotes
it (a label change: the same pod, not a new one) and the pool refills; scaling down demotes first.
(The plan itself: test_warmpool_plan.py; on real engines and a router: e2e/test_warmpool.py.)"""
from __future__ import annotations

import threading
import urllib.request

import kubernetes
import urllib3

from kiln.local.cluster import free_port
from operator_support import GROUP, PLURAL, VERSION, apply, condition, engines, events, isvc, ready, smollm2, until

NAME = "pooled"


def roles(apis, ns: str) -> dict[str, str]:
    """Live engine pod -> its kiln.dev/serving label, for ready pods."""
    found = apis["core"].list_namespaced_pod(ns, label_selector=engines(NAME)).items
    return {p.metadata.name: (p.metadata.labels or {}).get("kiln.dev/serving") for p in found
            if not p.metadata.deletion_timestamp
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])}


def slice_pods(apis, ns: str) -> set[str]:
    discovery = kubernetes.client.DiscoveryV1Api(apis["core"].api_client)
    found = discovery.list_namespaced_endpoint_slice(ns, label_selector=engines(NAME)).items
    return {e.target_ref.name for s in found for e in s.endpoints or [] if e.conditions and e.conditions.ready}


def scale(apis, ns: str, replicas: int) -> None:
    apis["custom"].patch_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, NAME, {"spec": {"replicas": replicas}})


def test_a_standby_is_never_routed_promoted_on_scale_up_and_refilled(operator, apis, ns, kubectl):
    port = free_port()
    operator.restart(f"--metrics-port={port}")
    body = smollm2(NAME)
    body["spec"]["warmPool"] = {"size": 1}
    apply(kubectl, ns, body)
    until(lambda: ready(apis, ns, NAME), "Ready")
    pool = until(lambda: sorted(roles(apis, ns).values()) == ["false", "true"] and roles(apis, ns), "1 serving + 1 standby")
    standby = next(p for p, role in pool.items() if role == "false")
    serving = next(p for p, role in pool.items() if role == "true")
    until(lambda: slice_pods(apis, ns) == {serving}, "only the serving pod in the EndpointSlices")
    obj = until(lambda: (o := isvc(apis, ns, NAME))["status"].get("warmReplicas") == 1 and o, "warmReplicas 1")
    assert condition(obj, "WarmPoolReady")["status"] == "True"
    assert obj["status"]["desiredReplicas"] == 1 and obj["status"]["warmPool"]["size"] == 1
    # Replicas count what serves, in status and in /scale (which an HPA reads back): not the standby.
    obj = until(lambda: (o := isvc(apis, ns, NAME))["status"]["readyReplicas"] == 1 and o, "readyReplicas 1")
    assert obj["status"]["replicas"] == 1 and [(r["replicas"], r["ready"]) for r in obj["status"]["revisions"]] == [(1, 1)]
    scale_status = apis["custom"].get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, NAME)["status"]
    assert scale_status["replicas"] == 1
    # An HPA averages its pods metric over /scale's selector: the standby (load 0) is not among them.
    selected = apis["core"].list_namespaced_pod(ns, label_selector=scale_status["selector"]).items
    assert [p.metadata.name for p in selected if not p.metadata.deletion_timestamp] == [serving]
    promotions = obj["status"]["warmPool"]["promotions"]  # the first serving pod was a promoted standby too

    scale(apis, ns, 2)  # the standby is promoted (the same pod), a new standby refills the pool
    until(lambda: roles(apis, ns).get(standby) == "true", "the standby promoted")
    until(lambda: slice_pods(apis, ns) == {serving, standby}, "the promoted pod routed")
    after = until(lambda: sorted((r := roles(apis, ns)).values()) == ["false", "true", "true"] and r, "the pool refilled")
    assert {serving, standby} < set(after)
    assert any(e.reason == "Promoted" and standby in e.message for e in events(apis, ns, NAME))
    obj = until(lambda: (o := isvc(apis, ns, NAME))["status"]["warmPool"]["promotions"] == promotions + 1 and o,
                "the promotion counted")
    assert obj["status"]["warmPool"]["lastPromotion"]
    until(lambda: (s := isvc(apis, ns, NAME)["status"])["readyReplicas"] == 2 and s["replicas"] == 2, "2 serving")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        page = response.read().decode()
    assert f'kiln_operator_warm_pool_promotions_total{{inferenceservice="{NAME}",namespace="{ns}"}} {promotions + 1}.0' \
        in page and "kiln_operator_warm_pool_promotion_seconds_count" in page

    # To zero: both serving pods are demoted, and the ReplicaSet removes two of the three standbys,
    # never a serving pod, though the pool (one) is smaller than the step down (two). Demoted
    # before the Deployment shrinks: the other order deleted a pod still labelled serving.
    deleted_serving: list[str] = []
    watching = kubernetes.watch.Watch()

    def watch() -> None:
        try:
            for event in watching.stream(apis["core"].list_namespaced_pod, ns, label_selector=engines(NAME),
                                         timeout_seconds=120):
                pod = event["object"]
                if pod.metadata.deletion_timestamp and (pod.metadata.labels or {}).get("kiln.dev/serving") == "true":
                    deleted_serving.append(pod.metadata.name)
        except urllib3.exceptions.ProtocolError:  # stop() cuts the stream mid-read
            pass
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    scale(apis, ns, 0)
    until(lambda: sorted(roles(apis, ns).values()) == ["false"] and not slice_pods(apis, ns), "1 standby, no one routed")
    until(lambda: sum(e.reason == "Demoted" for e in events(apis, ns, NAME)) == 2, "both Demoted Events")
    (dep,) = apis["apps"].list_namespaced_deployment(ns, label_selector=engines(NAME)).items
    assert dep.spec.replicas == 1
    until(lambda: len(apis["core"].list_namespaced_pod(ns, label_selector=engines(NAME)).items) == 1, "two deleted")
    watching.stop()
    watcher.join(10)
    assert deleted_serving == [] and not watcher.is_alive()
    operator.restart()


def test_a_dead_standby_is_replaced_a_new_revision_gets_its_own_pool_and_a_short_pool_says_so(
        operator, apis, ns, kubectl):
    body = smollm2("faults")
    body["spec"]["warmPool"] = {"size": 1}
    apply(kubectl, ns, body)
    until(lambda: ready(apis, ns, "faults"), "Ready")

    def live(role: str) -> list[str]:
        found = apis["core"].list_namespaced_pod(ns, label_selector=engines("faults") + f",kiln.dev/serving={role}")
        return [p.metadata.name for p in found.items if not p.metadata.deletion_timestamp
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    (serving,), (standby,) = until(lambda: len(live("true")) == len(live("false")) == 1
                                   and (live("true"), live("false")), "1 serving + 1 standby")
    apis["core"].delete_namespaced_pod(standby, ns)  # a standby dies: the ReplicaSet replaces it
    until(lambda: (s := live("false")) and s[0] != standby, "a new standby")
    assert live("true") == [serving]

    # A new revision (no rollout: it replaces the old one) comes with its own pool.
    body["spec"]["engine"]["quantization"] = "int8"
    apply(kubectl, ns, body)
    (old,) = {d.metadata.name for d in apis["apps"].list_namespaced_deployment(ns, label_selector=engines("faults")).items}
    until(lambda: [d.metadata.name for d in apis["apps"].list_namespaced_deployment(
        ns, label_selector=engines("faults")).items if d.metadata.name != old and d.spec.replicas == 2],
        "the new revision at serving + pool")
    until(lambda: all(d.metadata.name != old for d in apis["apps"].list_namespaced_deployment(
        ns, label_selector=engines("faults")).items), "the old revision and its pool gone")
    until(lambda: len(live("true")) == len(live("false")) == 1, "the new revision's 1 serving + 1 standby")

    # More standbys than the nodes have GPUs for (two kwok nodes of 4): said in WarmPoolReady.
    short = smollm2("short", gpus=4)
    short["spec"]["warmPool"] = {"size": 2}
    apply(kubectl, ns, short)
    cond = until(lambda: (c := condition(isvc(apis, ns, "short"), "WarmPoolReady")).get("reason")
                 == "InsufficientCapacity" and c, "WarmPoolReady InsufficientCapacity")
    assert cond["status"] == "False" and "gpu" in cond["message"]
    apis["custom"].delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "short")
