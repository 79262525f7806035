"""A reconcile pass's part in a rollout: gather the facts the step machine needs (which
revision is stable, how ready the canary is, the annotations, an analysis interval that
ended), run it, and say how traffic splits. The routers are scraped here; the decisions are
rollout.py's and analysis.py's, both pure."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .analysis import Check, Figures, check, figures
from .desired import Split, canary_size, fully_ready
from .models import InferenceServiceSpec, seconds
from .observed import Observed, engine_failure, is_ready, replicas_of
from .render import ROUTER_PORT, Owner, revision_name
from .rollout import (FAILED_STARTS, PROMOTED, RESUME_ANNOTATION, RETRY_ANNOTATION, ROLLED_BACK, Decision, Facts, State,
                      advance, load)
from .scaling import epoch, serving_replicas
from .scrape import read_all
from .status import deployment_failure


# A router busy with a rollout's load can be slow to render /metrics; an analysis that misses
# its scrape waits a whole interval, so it waits longer than the autoscaler's 1 s.
ANALYSIS_SCRAPE_S = 5.0


@dataclass(frozen=True)
class Baseline:
    """The routers' counters when the current analysis interval began (memory of this process:
    after an operator restart the interval starts again, the step and its pause do not)."""
    time: float
    canary: str
    figures: dict[str, dict[str, Figures]]  # router pod uid -> revision -> figures


def stable_revision(previous: dict[str, Any], state: State | None, target: str) -> str:
    """The stable revision as the last pass left it; the spec's own on the first pass."""
    if state is not None:
        return state.stable
    return next((r["name"] for r in previous.get("revisions") or [] if r.get("role") == "stable"), target)


def last_ready_turn(pods: list[dict[str, Any]], to: str) -> float | None:
    """The latest turn of the pods' Ready condition to `to` ("True" or "False"). To False: with
    none of them ready, since when the revision has had no ready replica. To True: when a replica
    was last added, the progress of a canary scaling up. A pod being deleted (evicted by a node
    drain) still says Ready since it started, which read as the time it was lost and rolled the
    canary back at once: it tells nothing, and the first pass that sees it gone keeps its own time."""
    times = [epoch(c.get("lastTransitionTime")) for p in pods if not p["metadata"].get("deletionTimestamp")
             for c in (p.get("status") or {}).get("conditions") or []
             if c.get("type") == "Ready" and c.get("status") == to]
    return max((t for t in times if t is not None), default=None)


def router_figures(observed: Observed) -> dict[str, dict[str, Figures]] | None:
    """Each ready router's per-revision figures, by pod uid; None when none answered."""
    routers = [p for p in observed.pods(component="router") if is_ready(p)]
    urls = [f"http://{p['status']['podIP']}:{ROUTER_PORT}/metrics" for p in routers]
    pages = read_all(urls, ANALYSIS_SCRAPE_S) if urls else []
    return {p["metadata"]["uid"]: figures(page) for p, page in zip(routers, pages) if page is not None} or None


def interval(taken: dict[str, dict[str, Figures]], base: dict[str, dict[str, Figures]], revision: str) -> Figures:
    """What the routers counted for `revision` since `base`, router by router, as Prometheus'
    increase() takes each series before a sum: a router missing from one scrape (slow, not
    ready) must not turn the others' lifetime counts into this interval's. A router missing
    from either snapshot adds nothing. A router that restarted (any of its counters went down)
    counts from zero, every counter of it: judged counter by counter, those that had climbed
    back past their old values mixed an increase with lifetime counts (a false error rate). A
    revision whose series went is a retired one (a router drops them minutes after its Service),
    no restart, unless it is `revision` itself: live, it loses its series only with its router."""
    empty, total = Figures(), Figures()
    for router in taken.keys() & base.keys():
        now, then = taken[router], base[router]
        if any(now[r].fell_below(figures) if r in now else r == revision for r, figures in then.items()):
            then = {}
        total = total.plus(now.get(revision, empty).minus(then.get(revision, empty)))
    return total


def analyse(spec: InferenceServiceSpec, observed: Observed, state: State, baselines: dict[Any, Baseline],
            key: Any, now: float) -> Check | None:
    """A check when an analysis interval ended in this pass, else None (and the first pass of
    a canary, or of this process, only takes the baseline)."""
    assert spec.rollout is not None and state.canary is not None
    base = baselines.get(key)
    if base is not None and base.canary == state.canary and now - base.time < seconds(spec.rollout.analysis.interval):
        return None
    taken = router_figures(observed)
    if taken is None:
        return None
    baselines[key] = Baseline(now, state.canary, taken)
    if base is None or base.canary != state.canary:
        return None
    return check(interval(taken, base.figures, state.canary), interval(taken, base.figures, state.stable),
                 spec.rollout.analysis)


def replacing(spec: InferenceServiceSpec, observed: Observed, stable: str, target: str) -> list[str]:
    """The revisions a plain replacement (the spec changed before it had a rollout) still replaces,
    while the stable revision is short of full strength; none once it is, or when it is stuck. They
    serve meanwhile, and a canary's start would retire them at once: it waits, as it would for any
    stable revision to be ready, but not for a stuck one, which it may be there to fix."""
    current = observed.engine(stable)
    if fully_ready(current, serving_replicas(spec, current)) or stuck(observed, stable):
        return []
    return sorted(d["metadata"]["name"] for d in observed.engines() if d["metadata"]["name"] not in (stable, target))


def stuck(observed: Observed, revision: str) -> bool:
    """A revision's Deployment makes no progress (past its progressDeadlineSeconds, or its pods
    cannot be created), or an engine of it failed to start FAILED_STARTS times."""
    deployment = observed.engine(revision)
    return deployment is not None and deployment_failure(deployment) is not None \
        or engine_failure(observed.pods(revision), FAILED_STARTS) is not None


def unserviceable(observed: Observed, revision: str) -> str | None:
    """Why a stable revision can serve nobody, or None: its Deployment is gone (deleted by hand),
    or no pod of it is ready and its engine fails to start (a first revision that never served,
    a typo fixed in the next spec). A revision at zero, or still loading, is not."""
    if observed.engine(revision) is None:
        return "was gone"
    pods = observed.pods(revision)
    failing = None if any(is_ready(p) for p in pods) else engine_failure(pods, FAILED_STARTS)
    return None if failing is None else f"serves nobody: its engine failed to start {FAILED_STARTS} times ({failing})"


def roll(owner: Owner, spec: InferenceServiceSpec, observed: Observed, annotations: Mapping[str, str],
         previous: dict[str, Any], baselines: dict[Any, Baseline], now: float) -> Decision | None:
    """The rollout's next state; None when the spec has no rollout (revisions replace each other)."""
    if spec.rollout is None:
        baselines.pop((owner.namespace, owner.name), None)
        return None
    target = revision_name(owner.name, spec)
    state = load(previous.get("rollout"))
    stable = stable_revision(previous, state, target)
    gone = unserviceable(observed, stable) if stable != target else None
    if gone is not None:
        # Nothing to compare with, and nobody served by a canary's steps (the router holds the
        # stable share, for no one): the spec's revision replaces it at once, as without a rollout.
        state, stable = State("Promoted", target, message=f"stable revision {stable} {gone}; {target} serves"), target
    canary = state.canary if state is not None and state.active else None
    canary_deployment = observed.engine(canary) if canary else None
    serving = serving_replicas(spec, observed.engine(stable))
    step = state.step if state is not None and canary else 0
    weight = spec.rollout.steps[step - 1].weight if 1 <= step <= len(spec.rollout.steps) else 0
    facts = Facts(canary_ready=sum(1 for p in observed.pods(canary) if is_ready(p)) if canary else 0,
                  canary_full=canary_deployment is not None
                  and replicas_of(canary_deployment) >= serving
                  and fully_ready(canary_deployment, replicas_of(canary_deployment)),
                  retry_token=annotations.get(RETRY_ANNOTATION), resume_token=annotations.get(RESUME_ANNOTATION),
                  unready_since=last_ready_turn(observed.pods(canary), "False") if canary else None,
                  became_ready=last_ready_turn(observed.pods(canary), "True") if canary else None,
                  failing=engine_failure(observed.pods(canary), FAILED_STARTS) if canary else None,
                  step_size=canary_size(serving, weight))
    result = None
    if state is not None and state.active and state.step >= 1 and state.canary == target:
        result = analyse(spec, observed, state, baselines, (owner.namespace, owner.name), now)
    decision = advance(spec.rollout, state, stable, target, facts, result, now)
    starting = not (state and state.active) and decision.state.active
    if starting and (replaced := replacing(spec, observed, stable, target)):
        waiting = state or State(PROMOTED, stable)
        return Decision(replace(waiting, message=f"canary {target} starts once {stable} has replaced "
                                                 f"{', '.join(replaced)} (it is not ready yet)"))
    if not decision.state.active or any(e.reason in ("RolloutStarted", "RolloutStep") for e in decision.events):
        # The rollout ended (promoted, rolled back, aborted) or another began: one that starts
        # later, even of the same revision, must not count this one's requests in its first interval.
        # Nor may a step's first check judge the last step's traffic (another weight).
        baselines.pop((owner.namespace, owner.name), None)
    return decision


def split(spec: InferenceServiceSpec, decision: Decision | None) -> Split | None:
    if decision is None or spec.rollout is None:
        return None
    return Split(decision.state.stable, decision.canary, decision.weight(spec.rollout),
                 decision.full_size(spec.rollout), dropped=decision.state.phase == ROLLED_BACK)
