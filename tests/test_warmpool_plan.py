"""The warm pool's plan as a pure function: which pods of a revision are promoted from standby
to serving or demoted back (warmpool.py), and the pool's status. (Against the real API server:
test_operator_warmpool.py; on real engines: e2e/test_warmpool.py.)"""
from __future__ import annotations

from kiln.operator.warmpool import DELETION_COST, Pod, PoolPlan, plan_pool, pool_status


def pods(*specs: str) -> list[Pod]:
    """'s+' a ready serving pod, 'w+' a ready standby, 'w-' a standby still loading; named p0, p1,
    ... in creation order."""
    return [Pod(f"p{i}", s[1] == "+", s[0] == "s", f"2026-01-01T00:00:0{i}Z") for i, s in enumerate(specs)]


def test_ready_standbys_are_promoted_oldest_first_and_loading_ones_never():
    assert plan_pool(3, pods("s+", "w-", "w+", "w+")) == PoolPlan(promote=["p2", "p3"])
    assert plan_pool(2, pods("s+", "w-")) == PoolPlan()  # the standby still loads: nothing to promote yet
    assert plan_pool(1, pods("w+", "w+")) == PoolPlan(promote=["p0"])  # from zero serving


def test_serving_pods_beyond_the_wanted_are_demoted_newest_first():
    assert plan_pool(1, pods("s+", "s+", "s+", "w+")) == PoolPlan(demote=["p2", "p1"])
    assert plan_pool(0, pods("s+")) == PoolPlan(demote=["p0"])
    assert plan_pool(2, pods("s+", "s+", "w+")) == PoolPlan()  # steady: nothing


def test_patches_relabel_and_make_standbys_the_cheaper_to_delete():
    patches = PoolPlan(promote=["a"], demote=["b"]).patches()
    assert patches["a"]["metadata"]["labels"] == {"kiln.dev/serving": "true"}
    assert patches["b"]["metadata"]["labels"] == {"kiln.dev/serving": "false"}
    promoted, demoted = (int(patches[p]["metadata"]["annotations"][DELETION_COST]) for p in "ab")
    assert demoted < promoted


def test_pool_status_counts_ready_standbys_and_accumulates_idle_cost():
    block, cond = pool_status(2, pods("s+", "w+", "w-"), None, 0, {}, gpus=1, now=1000.0)
    assert (block["ready"], block["idleReplicaSeconds"], cond["reason"]) == (1, 0.0, "Filling")
    block, cond = pool_status(2, pods("s+", "w+", "w+"), None, 1, block, gpus=2, now=1010.0)
    # 10 s at the 1 standby the previous pass saw: 10 replica-seconds, 20 GPU-seconds.
    assert (block["idleReplicaSeconds"], block["idleGPUSeconds"], block["promotions"]) == (10.0, 20.0, 1)
    assert cond["status"] == "True" and "lastPromotion" in block
    _, cond = pool_status(2, pods("s+", "w-"), "0/2 nodes have enough nvidia.com/gpu", 0, block, 1, 1020.0)
    assert (cond["status"], cond["reason"]) == ("False", "InsufficientCapacity")
