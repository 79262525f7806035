"""The warm pool's plan as a pure function: which pods of a revision are promoted from standby
to serving or demoted back (warmpool.py), and the pool's status. (Against the real API server:
test_operator_warmpool.py; on real engines: e2e/test_warmpool.py.)"""
from __future__ import annotations

from kiln.operator.warmpool import ASLEEP, DELETION_COST, Pod, PoolPlan, plan_pool, pods_of, pool_status


def pods(*specs: str) -> list[Pod]:
    """'s+' a ready serving pod, 's-' a serving pod no longer ready, 'w+' a ready standby, 'w-' a standby still loading, 'z+' a ready
    standby asleep; named p0, p1, ... in creation order."""
    return [Pod(f"p{i}", s[1] == "+", s[0] == "s", f"2026-01-01T00:00:0{i}Z", asleep=s[0] == "z")
            for i, s in enumerate(specs)]


def rolled(*specs: str) -> list[Pod]:
    """Pods of a Deployment rolling in place: 'old:s+', 'new:w+', a template, then as pods()."""
    return [Pod(f"p{i}", s[-1] == "+", s[-2] == "s", f"2026-01-01T00:00:0{i}Z", template=s.split(":")[0])
            for i, s in enumerate(specs)]


def names(plan: PoolPlan) -> dict[str, list[str]]:
    return {role: [p.name for p in getattr(plan, role)] for role in ("promote", "demote", "sleep")
            if getattr(plan, role)}


def test_ready_standbys_are_promoted_oldest_first_and_loading_ones_never():
    assert names(plan_pool(3, pods("s+", "w-", "w+", "w+"))) == {"promote": ["p2", "p3"]}
    assert names(plan_pool(2, pods("s+", "w-"))) == {}  # the standby still loads: nothing to promote yet
    assert names(plan_pool(1, pods("w+", "z+"))) == {"promote": ["p0"]}  # from zero serving


def test_serving_pods_beyond_the_wanted_are_demoted_newest_first():
    assert names(plan_pool(1, pods("s+", "s+", "s+", "w+"))) == {"demote": ["p2", "p1"]}
    assert names(plan_pool(0, pods("s+"))) == {"demote": ["p0"]}
    assert names(plan_pool(2, pods("s+", "s+", "w+"))) == {}  # steady: nothing


def test_with_sleep_awake_ready_standbys_that_stay_standbys_are_put_to_sleep():
    assert names(plan_pool(1, pods("s+", "w+", "z+", "w-"), sleep=True)) == {"sleep": ["p1"]}
    # The promoted standby is woken, not put to sleep; a sleeping one can be promoted.
    assert names(plan_pool(2, pods("s+", "w+", "w+"), sleep=True)) == {"promote": ["p1"], "sleep": ["p2"]}
    assert names(plan_pool(2, pods("s+", "z+", "w+"), sleep=True)) == {"promote": ["p1"], "sleep": ["p2"]}
    # A pod demoted this pass may still finish requests: it sleeps on a later pass.
    assert names(plan_pool(1, pods("s+", "s+", "z+"), sleep=True)) == {"demote": ["p1"]}
    assert names(plan_pool(1, pods("s+", "w+"))) == {}  # sleep off


def test_asleep_holds_only_while_the_engine_has_not_restarted():
    def pod(annotation: str | None, restarts: int) -> dict:
        return {"metadata": {"name": "p", "annotations": {ASLEEP: annotation} if annotation else {}},
                "status": {"podIP": "10.0.0.7", "containerStatuses": [{"restartCount": restarts}]}}
    assert [(p.asleep, p.ip) for p in pods_of([pod("0", 0)])] == [(True, "10.0.0.7")]
    assert not pods_of([pod("0", 1)])[0].asleep  # restarted since it was put to sleep: awake
    assert not pods_of([pod(None, 0)])[0].asleep


def test_patches_relabel_and_make_standbys_the_cheaper_to_delete():
    a, b = pods("w+", "s+")
    patches = PoolPlan(promote=[a], demote=[b]).patches()
    assert patches["p0"]["metadata"]["labels"] == {"kiln.dev/serving": "true"}
    assert patches["p1"]["metadata"]["labels"] == {"kiln.dev/serving": "false"}
    promoted, demoted = (int(patches[p]["metadata"]["annotations"][DELETION_COST]) for p in ("p0", "p1"))
    assert demoted < promoted
    assert patches["p0"]["metadata"]["annotations"][ASLEEP] is None  # a serving pod is awake


def test_idle_cost_adds_up_to_the_time_standbys_were_ready():
    """accountedAt is written in whole seconds: measured from it, each pass counted the dropped
    fraction again (14,801 replica-seconds for 14,398 s of one standby)."""
    block, now = {}, 1_000_000.7
    for _ in range(480):
        block, _ = pool_status(1, pods("s+", "w+"), None, 0, block, gpus=2, now=now)
        now += 30.9
    elapsed = now - 30.9 - 1_000_000.7
    assert abs(block["idleReplicaSeconds"] - elapsed) <= 1.0
    assert abs(block["idleGPUSeconds"] - 2 * elapsed) <= 2.0


def test_pool_status_counts_ready_standbys_and_accumulates_idle_cost():
    block, cond = pool_status(2, pods("s+", "w+", "w-"), None, 0, {}, gpus=1, now=1000.0)
    assert (block["ready"], block["idleReplicaSeconds"], cond["reason"]) == (1, 0.0, "Filling")
    block, cond = pool_status(2, pods("s+", "w+", "w+", "w+"), None, 1, block, gpus=2, now=1010.0)
    # 10 s at the 1 standby the previous pass saw: 10 replica-seconds, 20 GPU-seconds.
    assert (block["idleReplicaSeconds"], block["idleGPUSeconds"], block["promotions"]) == (10.0, 20.0, 1)
    assert cond["status"] == "True" and "lastPromotion" in block
    _, cond = pool_status(2, pods("s+", "w-"), "0/2 nodes have enough nvidia.com/gpu", 0, block, 1, 1020.0)
    assert (cond["status"], cond["reason"]) == ("False", "InsufficientCapacity")
    # Standbys a quota refuses: the Deployment's ReplicaFailure, quoted (Ready does not carry it).
    _, cond = pool_status(2, pods("s+", "w+"), None, 0, block, 1, 1030.0,
                          failure=("FailedCreate", "chat-x: exceeded quota: gpus"))
    assert (cond["status"], cond["reason"]) == ("False", "FailedCreate") and "exceeded quota" in cond["message"]


def test_a_ready_standby_takes_the_place_of_a_serving_pod_that_stopped_being_ready():
    # p1 crashed (CrashLoopBackOff, Ready=False): it serves nobody, so p2 is promoted and p1
    # demoted; it rejoins the pool once it recovers.
    assert names(plan_pool(2, pods("s+", "s-", "w+"))) == {"promote": ["p2"], "demote": ["p1"]}
    assert names(plan_pool(3, pods("s+", "s-", "w+"))) == {"promote": ["p2"]}  # still short: p1 may recover
    assert names(plan_pool(2, pods("s+", "s-", "w-"))) == {}  # no standby ready: p1 keeps its place


def test_a_serving_pod_that_is_not_ready_is_demoted_first():
    assert names(plan_pool(1, pods("s-", "s+"))) == {"demote": ["p0"]}
    assert names(plan_pool(1, pods("s+", "s-", "s+", "s-"))) == {"demote": ["p3", "p1", "p2"]}


def test_pods_that_ended_for_good_or_terminate_are_neither_serving_nor_standby():
    def pod(name: str, phase: str = "Running", deleted: str | None = None) -> dict:
        return {"metadata": {"name": name, "labels": {"kiln.dev/serving": "true"}, "deletionTimestamp": deleted},
                "status": {"phase": phase}}
    evicted = pod("evicted", phase="Failed")  # a kubelet eviction: Failed, no deletionTimestamp
    terminating = pod("terminating", deleted="2026-01-01T00:00:00Z")
    assert [p.name for p in pods_of([evicted, terminating, pod("live")])] == ["live"]


def test_pool_cost_is_brought_up_to_date_every_30_s_or_when_the_pool_changes():
    """Accounting at every pass (each 0.5-2 s) would write the status each time."""
    block, _ = pool_status(1, pods("w+"), None, 0, {}, gpus=1, now=1000.0)
    for later in (1000.5, 1012.0, 1029.0):  # the same standby, ready: nothing changes
        assert pool_status(1, pods("w+"), None, 0, block, gpus=1, now=later)[0] == block
    later, _ = pool_status(1, pods("w+"), None, 0, block, gpus=1, now=1030.0)
    assert (later["idleReplicaSeconds"], later["idleGPUSeconds"]) == (30.0, 30.0)  # none of it lost
    grown, _ = pool_status(2, pods("w+", "w+"), None, 0, later, gpus=1, now=1031.0)  # a second standby
    assert (grown["ready"], grown["idleReplicaSeconds"]) == (2, 31.0)


def test_a_rolling_template_is_served_by_its_new_pods_before_the_old_ones_go():
    """An in-place roll (an operator upgrade, new resources): new pods are born standbys and count
    as available, so the old ReplicaSet removed its serving pod next, and only then was a new
    standby promoted: nothing served meanwhile."""
    # 1 serving + 1 standby of the old template, a new standby ready: it takes the serving place.
    assert names(plan_pool(1, rolled("old:s+", "old:w+", "new:w+"))) == {"promote": ["p2"], "demote": ["p0"]}
    # The new one still loads: the old pod serves on.
    assert names(plan_pool(1, rolled("old:s+", "new:w-"))) == {}
    # Two serving: each new ready pod replaces an old one (the oldest first).
    assert names(plan_pool(2, rolled("old:s+", "old:s+", "new:w+"))) == {"promote": ["p2"], "demote": ["p0"]}
    assert names(plan_pool(2, rolled("old:s+", "new:s+", "new:w+"))) == {"promote": ["p2"], "demote": ["p0"]}
    # Done rolling: one template again, and the usual plan.
    assert names(plan_pool(2, rolled("new:s+", "new:s+", "new:w+"), sleep=True)) == {"sleep": ["p2"]}
    # The promoted pod is patched first: the Service never has fewer serving pods.
    plan = plan_pool(1, rolled("old:s+", "new:w+"))
    assert list(plan.patches()) == ["p1", "p0"]
    # A serving pod not ready keeps its place while no ready pod can take it.
    assert names(plan_pool(2, rolled("old:s-", "old:s+", "new:w-"))) == {}
    assert [p.template for p in pods_of([{"metadata": {"name": "p", "labels": {"pod-template-hash": "abc"}},
                                          "status": {}}])] == ["abc"]


def test_a_roll_swaps_no_ready_pod_for_another_of_its_own_template():
    """plan_roll kept the newest ready pods of each template: at a roll's start an old standby newer
    than the old serving pod took its place (a demotion mid-request and a wake, for nothing), and
    each new pod made ready later demoted the new one serving before it."""
    assert names(plan_pool(1, rolled("old:s+", "old:w+", "new:w-"))) == {}
    assert names(plan_pool(1, rolled("old:w+", "new:s+", "new:w+"))) == {}
    assert names(plan_pool(2, rolled("old:s+", "old:s+", "old:w+", "new:w-"))) == {}
    # The new template still serves first: a ready new pod takes an old one's place.
    assert names(plan_pool(2, rolled("old:s+", "new:s+", "old:w+", "new:w+"))) == {"promote": ["p3"], "demote": ["p0"]}


def test_standbys_promoted_this_pass_are_no_longer_counted_in_the_pool():
    """pool_status sees the pods as read before the promotions: the two standbys a scale-up just
    took were still counted, WarmPoolReady said Filled (then Filling on the next pass, two Events)
    and their time serving was accounted as idle pool time."""
    block, cond = pool_status(2, pods("s+", "w+", "w+"), None, 0, {}, gpus=1, now=1000.0)
    assert (block["ready"], cond["reason"]) == (2, "Filled")
    block, cond = pool_status(2, pods("s+", "w+", "w+"), None, 2, block, gpus=1, now=1010.0)
    assert (block["ready"], block["promotions"], cond["reason"]) == (0, 2, "Filling")
    block, _ = pool_status(2, pods("s+", "s+", "s+", "w-", "w-"), None, 0, block, gpus=1, now=1020.0)
    assert block["idleReplicaSeconds"] == 20.0  # 2 standbys for 10 s, none since


def test_standbys_stay_awake_unless_sleep_is_asked_for():
    """sleep defaulted to true, unlike vLLM's opt-in sleep mode: on a GPU a pod holds alone the
    memory it freed served nothing else, while every promotion waited on a wake (CUDA graphs
    captured anew)."""
    from kiln.operator.models import WarmPool
    assert not WarmPool(size=1).sleep and WarmPool(size=1, sleep=True).sleep
