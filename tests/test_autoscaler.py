"""The builtin autoscaler's decision function on load series, tick by tick as the operator runs
it (every 2 s), with its state carried from one decision to the next exactly as status keeps it."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kiln.operator.autoscaler import MAX_SCALE_UP_RATE, PANIC_THRESHOLD, Decision, Sample, ScalerState, decide
from kiln.operator.models import Autoscaling, seconds
from kiln.operator.scaling import iso, scaler_state
from kiln.operator.scrape import scrape

TICK = 2.0


def spec(**kw) -> Autoscaling:
    base = dict(mode="builtin", minReplicas=1, maxReplicas=10, targetQueueDepth=4, stableWindow="60s",
                panicWindow="6s", scaleDownDelay="5m")
    return Autoscaling.model_validate({**base, **kw})


@dataclass
class Run:
    """Replays a load series; ready replicas follow decisions after `start_ticks` ticks."""
    scaling: Autoscaling
    replicas: int = 1
    start_ticks: int = 0
    now: float = 1_000_000.0
    samples: list[Sample] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    pending: list[tuple[float, int]] = field(default_factory=list)  # (ready at, replicas)

    def __post_init__(self) -> None:
        self.state = ScalerState(self.replicas)
        self.ready = self.replicas

    def tick(self, load: float | None) -> Decision:
        self.now += TICK
        if load is not None:
            self.samples.append(Sample(self.now, load))
        for at, replicas in list(self.pending):
            if at <= self.now:
                self.ready = replicas
                self.pending.remove((at, replicas))
        starting = max(0, self.state.replicas - self.ready)
        decision, self.state = decide(self.samples, self.scaling, self.state, self.ready, starting, self.now)
        if decision.replicas > self.ready:
            self.pending.append((self.now + self.start_ticks * TICK, decision.replicas))
        elif decision.replicas < self.ready:
            self.ready = decision.replicas
        self.decisions.append(decision)
        return decision

    def run(self, loads: list[float | None]) -> list[int]:
        return [self.tick(load).replicas for load in loads]


def test_durations():
    assert (seconds("90s"), seconds("5m"), seconds("1h30m"), seconds("500ms")) == (90, 300, 5400, 0.5)


def test_a_step_up_panics_and_scales_within_the_panic_window():
    run = Run(spec(), start_ticks=10)  # new replicas take 20 s to load
    run.run([4.0] * 30)  # one replica's worth for a minute
    assert run.state.replicas == 1 and run.decisions[-1].mode == "stable"
    replicas = run.run([20.0] * 3)  # 5 replicas' worth: 5 >= 2 x 1 ready
    assert replicas[0] > 1 and run.decisions[-1].mode == "panic"  # the first tick of the step
    # Bounded: at most MAX_SCALE_UP_RATE x the ready replicas per decision, while they load.
    assert replicas == [MAX_SCALE_UP_RATE * 1] * 3


def test_panic_keeps_scaling_as_replicas_come_up_and_never_down():
    run = Run(spec(), start_ticks=2)
    replicas = run.run([20.0] * 10)
    assert replicas[-1] == 5 and replicas == sorted(replicas)
    # Load gone: panic holds for a stable window, then the scale-down delay holds.
    after = run.run([0.0] * int(seconds("60s") / TICK))
    assert set(after) == {5}


def test_a_panic_held_at_max_replicas_moves_panic_until_in_steps_not_every_pass():
    # Asking for more than maxReplicas, it panicked on every pass and wrote a new panicUntil (a
    # status PATCH, an event to every router watching) each time.
    run = Run(spec(maxReplicas=3), replicas=3)
    run.run([40.0] * 5)
    seen = set()
    for _ in range(60):
        run.tick(40.0)
        seen.add(run.state.panic_until)
    assert {d.mode for d in run.decisions[-60:]} == {"panic"} and run.state.replicas == 3
    assert len(seen) <= 60 * TICK / (seconds("60s") / 10) + 1
    # The panic ends about a stable window after its last ask, not before nine tenths of one.
    last = run.now
    while run.tick(0.0).mode == "panic":
        pass
    assert 0.9 * seconds("60s") <= run.now - last <= seconds("60s") + TICK


def test_a_burst_shorter_than_the_stable_window_does_not_scale_down_before_the_delay():
    run = Run(spec(minReplicas=1), start_ticks=1)
    run.run([4.0] * 30)
    run.run([40.0] * 5)  # a 10 s burst
    peak = run.state.replicas
    assert peak > 1
    quiet = run.run([4.0] * int(seconds("5m") / TICK - 10))
    assert set(quiet) == {peak}  # lower demand, but not for scaleDownDelay yet
    assert run.decisions[-1].reason == "ScaleDownDelayed"
    # (One pass more than the delay: an ask that gave way to a lower one is taken as asked until
    # that pass, as the last ask's time is its run's start, kept so status is not rewritten.)
    later = run.run([4.0] * 41)
    assert later[-1] == 1 and run.decisions[-1].reason == "Scaled"


def test_scale_to_zero_and_from_zero():
    run = Run(spec(minReplicas=0, scaleDownDelay="30s"))
    replicas = run.run([0.0] * 60)
    assert replicas[-1] == 0 and run.decisions[-1].reason == "ScaledToZero"
    zero_at = replicas.index(0)
    assert zero_at * TICK >= seconds("30s")
    # A request held at the router is load: one replica at once.
    assert run.tick(1.0).replicas == 1


def test_missing_samples_hold_replicas_and_stale_ones_are_dropped():
    run = Run(spec(minReplicas=0, scaleDownDelay="10s"), replicas=3)
    run.ready = 3
    held = run.run([None] * 20)  # every scrape failed
    assert set(held) == {3} and run.decisions[-1].reason == "MetricsUnavailable"
    assert run.decisions[-1].ok is False
    # Samples older than the stable window are never averaged in: one old spike is no load.
    run = Run(spec(), replicas=1)
    run.samples.append(Sample(run.now - 3600, 1000.0))
    assert run.tick(4.0).replicas == 1


def test_clamps_hold():
    run = Run(spec(minReplicas=2, maxReplicas=3), replicas=2, start_ticks=0)
    run.ready = 2
    replicas = run.run([400.0] * 10)
    assert max(replicas) == 3 and run.decisions[-1].reason == "AtMaxReplicas"
    quiet = Run(spec(minReplicas=2, maxReplicas=3, scaleDownDelay="2s"), replicas=2)
    quiet.ready = 2
    assert min(quiet.run([0.0] * 40)) == 2


def test_no_flapping_with_zero_traffic():
    run = Run(spec(minReplicas=0, scaleDownDelay="20s"))
    replicas = run.run([0.0] * 300)  # ten minutes of nothing
    changes = sum(1 for a, b in zip(replicas, replicas[1:]) if a != b)
    assert changes == 1 and replicas[-1] == 0


def test_a_loading_replica_is_never_scaled_away():
    run = Run(spec(minReplicas=0, scaleDownDelay="4s"), replicas=0, start_ticks=100)  # weights load slowly
    run.ready = 0
    assert run.tick(1.0).replicas == 1  # a held request
    replicas = run.run([0.0] * 60)  # the request timed out meanwhile: no load, the pod still loads
    assert set(replicas) == {1} and "loading" in run.decisions[-1].message


def test_a_restart_with_the_persisted_state_continues_the_same_decision():
    run = Run(spec(scaleDownDelay="60s"), start_ticks=1)
    run.run([40.0] * 6)
    run.run([4.0] * 35)  # demand fell; panic ended after a stable window; the scale-down timer runs
    state = run.state
    assert state.lower_since is not None and state.replicas > 1
    # A restarted operator has no samples but the status: it holds, then scales down on time.
    restarted = Run(spec(scaleDownDelay="60s"), replicas=state.replicas)
    restarted.now, restarted.state, restarted.ready = run.now, state, state.replicas
    replicas = restarted.run([4.0] * 30)
    due = int((state.lower_since + 60 - run.now) / TICK)
    assert set(replicas[:due - 1]) == {state.replicas} and replicas[-1] == 1


def test_panic_threshold_is_relative_to_ready_replicas():
    run = Run(spec(), replicas=4)
    run.ready = 4
    run.run([16.0] * 30)  # 4 replicas' worth: no change
    assert run.state.replicas == 4
    # 7 replicas' worth is less than 2 x 4 ready: stable window decides, no panic.
    run.tick(28.0)
    assert run.decisions[-1].mode == "stable" and PANIC_THRESHOLD == 2.0


def test_a_lowered_max_replicas_applies_at_once_not_after_the_scale_down_delay():
    run = Run(spec(maxReplicas=10), replicas=8)
    run.ready = 8
    run.run([40.0] * 5)
    run.scaling = spec(maxReplicas=4)  # a spec edit
    assert run.tick(40.0).replicas == 4 and run.decisions[-1].reason == "AtMaxReplicas"
    assert run.state.replicas == 4
    # Also while a replica still loads, and with no fresh sample.
    state = ScalerState(8)
    assert decide([], spec(maxReplicas=4), state, 7, 1, 100.0)[0].replicas == 4
    assert decide([Sample(100.0, 40.0)], spec(maxReplicas=4), state, 7, 1, 100.0)[0].replicas == 4


def test_load_coming_back_is_not_scaled_away_on_a_stale_stable_average():
    # Demand alternates every 5 minutes between 3 replicas' worth and almost none. Once the
    # first trough outlasted the delay, a scale-down must not fall where the panic window
    # already shows the load back (3 -> 1 -> 2 -> 3 every cycle).
    run = Run(spec(scaleDownDelay="5m"), replicas=4, start_ticks=30)
    run.ready = 4
    replicas = run.run([10.0 if ((i + 40) // 150) % 2 == 0 else 0.5 for i in range(1800)])
    changes = [b for a, b in zip(replicas, replicas[1:]) if a != b]
    assert len(changes) <= 3 and replicas[-1] == 3
    assert 1 not in replicas[400:]


def test_a_scale_down_goes_to_the_most_demand_asked_for_during_the_delay():
    # 4 replicas; demand alternates every 90 s between 3 replicas' worth (12 at 4 each) and 1.
    # Knative and the HPA end the delay at the highest ask in it: 3, not wherever the last
    # sample happened to fall (4 -> 1 -> 2 -> 3 as the phases came and went).
    run = Run(spec(scaleDownDelay="5m", panicWindow="6s"), replicas=4)
    replicas = run.run([12.0 if (i // 45) % 2 == 0 else 1.0 for i in range(900)])
    assert sorted(set(replicas)) == [3, 4] and replicas[-1] == 3


def test_each_step_down_lands_on_the_most_asked_within_the_delay_before_it():
    # 10 replicas; demand asks 8 for 100 s, then 5 for 100 s, then 3. One remembered peak lost
    # the 5 when the step to 8 was taken, and went 8 -> 3 a delay later with 5 asked within it.
    delay = seconds("300s")
    run = Run(spec(maxReplicas=20, scaleDownDelay="300s", stableWindow="6s", panicWindow="6s"), replicas=10)
    asks = [8] * 50 + [5] * 50 + [3] * 300
    replicas = run.run([4.0 * ask for ask in asks])
    steps = [(i, r) for i, (q, r) in enumerate(zip(replicas, replicas[1:]), 1) if r != q]
    assert steps and replicas[-1] == 3
    for i, r in steps:
        assert r >= max(asks[max(0, i - int(delay / TICK) + 1): i + 1]), (i, r)
    assert 5 in replicas and 8 in replicas
    # The asks survive an operator restart: the status holds them as the autoscaler reads them back.
    run = Run(spec(maxReplicas=20, scaleDownDelay="300s", stableWindow="6s", panicWindow="6s"), replicas=10)
    run.run([32.0] * 50 + [20.0] * 10)
    saved = {"replicas": 10, "scaleDownSince": iso(run.state.lower_since),
             "scaleDownAsks": [{"replicas": ask, "time": iso(at)} for ask, at in run.state.lower_asks]}
    assert [ask for ask, _ in run.state.lower_asks][:1] == [8]
    assert scaler_state({"autoscaling": saved}, 1) == replace(run.state, last_scale=None, panic_until=None)


def test_a_steady_lower_demand_does_not_rewrite_the_status_while_the_delay_runs():
    # Every field of status.autoscaling comes from the state and the decision's message: were they
    # to change on every pass, the operator would PATCH status every 2 s for the whole delay.
    run = Run(spec(scaleDownDelay="5m", stableWindow="6s", panicWindow="6s"), replicas=4)
    run.run([4.0] * 10)  # one replica's worth: lower demand from now on
    seen = set()
    for _ in range(60):
        run.tick(4.0)
        seen.add((run.state, run.decisions[-1].message))
    assert len(seen) == 1 and run.decisions[-1].reason == "ScaleDownDelayed"


def test_pods_beyond_the_last_decision_do_not_hold_a_scale_down():
    # 3 serving and ready; one more pod loads that is no serving capacity on its way (a warm
    # pool refilling after a promotion, or a crash-looping standby): the delay alone holds.
    state = ScalerState(3, lower_since=0.0)
    samples = [Sample(1000.0 - i, 0.0) for i in range(60)]
    decision, _ = decide(samples, spec(minReplicas=1, scaleDownDelay="60s"), state, 3, 1, 1000.0)
    assert decision.replicas == 1
    # One the decision ordered and that still loads does hold it.
    decision, _ = decide(samples, spec(minReplicas=1, scaleDownDelay="60s"), state, 2, 1, 1000.0)
    assert (decision.replicas, decision.reason) == (3, "ScaleDownDelayed")


def pod(name: str, ready: bool, unschedulable: bool = False, serving: str | None = None) -> dict:
    conditions = [{"type": "Ready", "status": str(ready)}]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/2 nodes have enough nvidia.com/gpu"})
    labels = {"kiln.dev/component": "engine", "kiln.dev/revision": "r1",
              **({"kiln.dev/serving": serving} if serving else {})}
    return {"kind": "Pod", "metadata": {"name": name, "labels": labels}, "status": {"conditions": conditions}}


def test_a_pod_no_node_fits_is_not_loading_and_holds_no_scale_down():
    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import capacity, manual, pod_counts
    observed = Observed.of(pod("a", True), pod("b", False), pod("c", False, unschedulable=True),
                           pod("d", False, unschedulable=True), pod("e", True, serving="false"))
    assert pod_counts(observed, "r1") == (1, 1, 2, "0/2 nodes have enough nvidia.com/gpu")
    evicted = pod("f", False)
    evicted["status"]["phase"] = "Failed"  # kept until garbage collected; its replacement is already made
    assert pod_counts(Observed.of(pod("a", True), evicted), "r1") == (1, 0, 0, None)
    unpooled = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"}})
    assert capacity(manual(), observed, "r1", unpooled, 4).condition["message"] \
        .startswith("2 replica(s) cannot be scheduled")
    # After a burst ordered 3 and no node fits 2 of them, the load went: down after the delay.
    ready, loading, _, _ = pod_counts(Observed.of(pod("a", True), pod("c", False, unschedulable=True),
                                                  pod("d", False, unschedulable=True)), "r1")
    samples = [Sample(1000.0 - i, 0.0) for i in range(60)]
    decision, _ = decide(samples, spec(scaleDownDelay="60s"), ScalerState(3, lower_since=0.0), ready, loading,
                         1000.0)
    assert decision.replicas == 1


def test_a_pod_held_by_a_scheduling_gate_is_not_loading_and_holds_no_scale_down():
    """A scheduling gate (Kueue admitting pods against a quota) may hold a pod for good, as a
    missing node may: counted as loading, it held every scale-down, to zero too, while it waited."""
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import pod_counts
    gated = pod("b", False, unschedulable=True)
    gated["status"]["conditions"][1].update(reason="SchedulingGated",
                                            message="Scheduling is blocked due to non-empty scheduling gates")
    ready, loading, waiting, why = pod_counts(Observed.of(pod("a", True), gated), "r1")
    assert (ready, loading, waiting, why) == (1, 0, 1, "Scheduling is blocked due to non-empty scheduling gates")
    samples = [Sample(1000.0 - i, 0.0) for i in range(60)]
    decision, _ = decide(samples, spec(minReplicas=0, scaleDownDelay="60s"), ScalerState(2, lower_since=0.0),
                         ready, loading, 1000.0)
    assert (decision.replicas, decision.reason) == (0, "ScaledToZero")


def test_a_spike_during_an_update_scales_on_the_old_revisions_serving_replicas():
    """A plain update: the old revision serves it all while the new one's pods load. Counting the
    new revision's ready pods (0) alone, the rate limit held the decision at 4 for a 16-replica spike."""
    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import builtin

    def old(name: str) -> dict:
        p = pod(name, True)
        p["metadata"]["labels"]["kiln.dev/revision"] = "r0"
        return p
    isvc = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"},
                                                "autoscaling": spec(maxReplicas=32).model_dump()})
    observed = Observed.of(*(old(f"o{i}") for i in range(4)), *(pod(f"n{i}", False) for i in range(4)))
    samples = [Sample(1000.0 - i, 64.0) for i in range(10)]
    scaling = builtin(isvc, observed, "r1", {"autoscaling": {"replicas": 4}}, samples, 1000.0, 4)
    assert scaling.replicas == 8 and scaling.status["mode"] == "panic"  # twice the 4 that serve, as the rate allows


def test_only_serving_replicas_no_node_fits_are_insufficient_capacity_not_the_pools():
    """With a warm pool every pod is born a standby: one serving pod and a standby no node fits
    said ScalingReady=False InsufficientCapacity (and a Warning), a shortage of the pool only."""
    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import capacity, manual
    pooled = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"}, "warmPool": {"size": 1}})
    pool_short = Observed.of(pod("a", True, serving="true"), pod("b", False, unschedulable=True, serving="false"))
    assert capacity(manual(), pool_short, "r1", pooled, 1).condition["reason"] == "Manual"
    # Two serving wanted, one serves: the pending pod is a serving replica short, unless a ready
    # standby (promoted this pass) or a loading pod will serve in its place.
    cond = capacity(manual(), pool_short, "r1", pooled, 2).condition
    assert (cond["reason"], cond["message"][:39]) == ("InsufficientCapacity", "1 replica(s) cannot be scheduled: 0/2 n")
    for coming in (pod("c", True, serving="false"), pod("c", False, serving="false")):
        assert capacity(manual(), Observed.of(*pool_short.pods("r1"), coming), "r1", pooled, 2) \
            .condition["reason"] == "Manual"


def test_times_from_a_clock_ahead_hold_replicas_no_longer_than_this_clock_allows():
    # A former leader whose clock ran an hour ahead wrote panicUntil and scaleDownSince.
    now, idle = 1_000_000.0, [Sample(1_000_000.0 - i, 0.0) for i in range(60)]
    scaling = spec(scaleDownDelay="60s")
    _, state = decide(idle, scaling, ScalerState(5, panic_until=now + 3600), 5, 0, now)
    assert state.panic_until == now + seconds("60s")
    decision, state = decide(idle, scaling, ScalerState(5, lower_since=now + 3600), 5, 0, now)
    assert (decision.reason, state.lower_since) == ("ScaleDownDelayed", now)
    later = [Sample(now + 61 - i, 0.0) for i in range(60)]
    assert decide(later, scaling, state, 5, 0, now + 61)[0].replicas == 1


def test_a_pod_loading_past_the_deadline_holds_no_scale_down_even_to_zero():
    # Its engine's /health answers while it loads, so no probe ends a load hung on its storage:
    # counted as loading for ever, it held the scale to zero, and its GPU, for good.
    import datetime

    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.observed import Observed
    from kiln.operator.render import LOAD_DEADLINE_S
    from kiln.operator.scaling import builtin, pod_counts
    hung = pod("b", False)
    hung["status"]["startTime"] = "2026-01-01T00:00:00Z"
    started = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc).timestamp()
    observed = Observed.of(hung)
    assert pod_counts(observed, "r1", started + 60) == (0, 1, 0, None)  # on its way
    assert pod_counts(observed, "r1", started + LOAD_DEADLINE_S + 1) == (0, 0, 0, None)
    now = started + LOAD_DEADLINE_S + 120
    idle = [Sample(now - i, 0.0) for i in range(60)]
    scaling = spec(minReplicas=0, scaleDownDelay="60s")
    previous = {"autoscaling": {"replicas": 1, "scaleDownSince": "2026-01-01T00:00:00Z"}}
    model = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"},
                                                 "autoscaling": scaling.model_dump()})
    assert builtin(model, observed, "r1", previous, idle, now, 1).replicas == 0


def test_standbys_are_not_scraped_for_load():
    # A warm pool's ready standby serves nobody: its zero would stand in for a serving pod that
    # did not answer, and read a busy service as idle.
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import metrics_urls
    pods = [pod("a", True), pod("b", True, serving="false"), pod("c", False), pod("d", True, serving="true")]
    for i, p in enumerate(pods):
        p["status"]["podIP"] = f"10.0.0.{i}"
    engines, routers = metrics_urls(Observed.of(*pods))
    assert engines == ["http://10.0.0.0:8000/metrics", "http://10.0.0.3:8000/metrics"] and routers == []


def test_a_failing_pod_is_not_loading_and_holds_no_scale_down_even_to_zero():
    # A bad image tag, or an engine that runs out of memory on every start: it may never be
    # ready, and counted as loading it held every replica up for as long as it failed.
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import pod_counts
    pulling, crashing, restarting = pod("b", False), pod("c", False), pod("d", False)
    pulling["status"]["containerStatuses"] = [{"name": "engine", "ready": False, "restartCount": 0,
                                               "state": {"waiting": {"reason": "ImagePullBackOff"}}}]
    crashing["status"]["containerStatuses"] = [{"name": "engine", "ready": False, "restartCount": 7,
                                                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
    restarting["status"]["containerStatuses"] = [{"name": "engine", "ready": False, "restartCount": 1,
                                                  "state": {"running": {}},
                                                  "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]
    observed = Observed.of(pod("a", True), pulling, crashing, restarting, pod("e", False))
    assert pod_counts(observed, "r1") == (1, 1, 0, None)  # e alone loads
    ready, loading, _, _ = pod_counts(Observed.of(pulling), "r1")
    samples = [Sample(1000.0 - i, 0.0) for i in range(60)]
    decision, _ = decide(samples, spec(minReplicas=0, scaleDownDelay="60s"), ScalerState(1, lower_since=0.0),
                         ready, loading, 1000.0)
    assert (decision.replicas, decision.reason) == (0, "ScaledToZero")


def test_a_missed_scrape_with_a_short_panic_window_decides_from_the_stable_one():
    """A 1s panic window holds one tick's sample at most: a scrape that failed left it empty, and
    the pass held as if blind (MetricsUnavailable, a Warning) with a stable window full of load."""
    run = Run(spec(panicWindow="1s"), replicas=2)
    run.run([8.0] * 10)
    decision = run.tick(None)
    assert (decision.replicas, decision.ok) == (2, True) and decision.reason != "MetricsUnavailable", decision
    assert run.tick(20.0).replicas > 2  # and its own sample again drives a scale-up
    # Scrapes that stay down are blindness, whatever the stable window holds: hold, never scale on
    # old samples (here to zero, with minReplicas 0 and the last samples idle).
    run = Run(spec(panicWindow="1s", minReplicas=0, scaleDownDelay="10s"), replicas=3)
    run.ready = 3
    held = run.run([0.0, 0.0] + [None] * 25)
    assert set(held) == {3} and run.decisions[-1].reason == "MetricsUnavailable", held


def test_a_raised_min_replicas_applies_at_once_with_or_without_metrics():
    # Metrics down for good (a NetworkPolicy keeping the operator out) and minReplicas raised to
    # pin capacity: it held at 0, saying so, while a lowered maxReplicas applied.
    decision, state = decide([], spec(minReplicas=2, maxReplicas=4), ScalerState(0), 0, 0, 1000.0)
    assert (decision.replicas, decision.reason, state.replicas) == (2, "MetricsUnavailable", 2)
    assert decide([Sample(1000.0, 0.0)], spec(minReplicas=2), ScalerState(0), 0, 0, 1000.0)[0].replicas == 2


def test_at_max_replicas_only_when_held_by_max_not_by_the_rate_limit():
    run = Run(spec(maxReplicas=100), replicas=2, start_ticks=100)
    run.ready = 2
    decision = run.tick(4000.0)  # asks for 1000; the rate limit allows 2 x MAX_SCALE_UP_RATE
    assert decision.replicas == int(2 * MAX_SCALE_UP_RATE) < 100 and decision.reason == "Scaled"
    capped = Run(spec(maxReplicas=3), replicas=2)
    capped.ready = 2
    assert capped.tick(400.0).reason == "AtMaxReplicas"


def test_the_builtin_autoscaler_starts_from_the_serving_replicas_of_a_pooled_revision():
    # Switched to builtin from another mode (no saved decision), with 1 serving and a warm pool of
    # 2: it started from the Deployment's 3, promoting both standbys at once.
    from kiln.operator.desired import desired
    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.observed import Observed
    from kiln.operator.render import Owner, revision_name
    from kiln.operator.scaling import current_replicas
    owner = Owner("chat", "ns", "uid")
    body = {"model": {"source": "builtin://smollm2-135m"}, "replicas": 1, "warmPool": {"size": 2}}
    manual = InferenceServiceSpec.model_validate(body)
    deployment = desired(owner, manual, Observed(), "img").stable.deployment
    deployment["spec"]["replicas"] = 3  # as the last pass scaled it: 1 serving + 2 standbys
    observed = Observed.of(deployment)
    builtin = InferenceServiceSpec.model_validate({**body, "autoscaling": {"mode": "builtin", "maxReplicas": 4}})
    assert current_replicas(builtin, observed, revision_name("chat", builtin), 1) == 1


@contextlib.contextmanager
def metrics_pages(*bodies: str) -> Iterator[list[str]]:
    """A real HTTP server per page, each answering GET with its metrics text; their URLs."""
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(self.server.body.encode())

        def log_message(self, *_: object) -> None:
            pass
    servers = []
    for body in bodies:
        servers.append(ThreadingHTTPServer(("127.0.0.1", 0), Metrics))
        servers[-1].body = body
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_port}/metrics" for s in servers]
    finally:
        for server in servers:
            server.shutdown()


def test_a_router_that_does_not_answer_counts_at_the_average_of_those_that_did():
    with metrics_pages("kiln_router_held_requests 10\n", "kiln:num_requests_waiting 4\nkiln:num_requests_running 10\n") \
            as (router, engine):
        silent = "http://127.0.0.1:9/metrics"  # nothing listens on the discard port
        taken = scrape([engine], [router, silent], 1000.0)
        assert taken.sample.load == 14.0 + 2 * 10.0  # the silent router holds what the other does


def test_every_engine_answering_sums_exactly_at_a_multiple_of_the_target():
    # 7 engines with 116 requests between them, 29 replicas' worth at 4 each: averaged then
    # multiplied back, the sample was 116.00000000000001 and ceil() ordered 30.
    engines = [f"kiln:num_requests_waiting {load}\nkiln:num_requests_running 0\n" for load in [16] * 3 + [17] * 4]
    with metrics_pages(*engines, "kiln_router_held_requests 0\n") as urls:
        sample = scrape(urls[:7], urls[7:], 1000.0).sample
    assert sample.load == 116
    decision, _ = decide([sample], spec(maxReplicas=100), ScalerState(29), 29, 0, 1000.0)
    assert decision.replicas == 29


def steady_passes(observed, n: int = 150):
    """n builtin passes, TICK apart, under steady traffic between 8.5 and 11.7 requests on 3
    replicas at 4 each (the decision holds, the load moves): when status changed, and the last."""
    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.scaling import builtin
    isvc = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"},
                                                "autoscaling": spec(stableWindow="6s").model_dump()})
    previous: dict = {"autoscaling": {"replicas": 3}}
    now, samples, written = 1_000_000.0, [], []
    for i in range(n):
        now += TICK
        samples.append(Sample(now, 8.5 + 0.8 * ((i * 7) % 5)))
        scaling = builtin(isvc, observed, "r1", previous, samples[-30:], now, 3)
        current = {"autoscaling": scaling.status, "conditions": [scaling.condition]}
        if current != previous:
            written.append(now)
        previous = current
        assert scaling.replicas == 3
    return written, isvc, previous, samples, now


def test_a_load_that_moves_under_a_steady_decision_is_written_every_15_s_not_every_pass():
    # The load (and the message quoting it) changed on most 2 s passes, each a status PATCH.
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import LOAD_EVERY_S, builtin
    observed = Observed.of(*(pod(name, True) for name in "abc"))
    written, isvc, previous, samples, now = steady_passes(observed)
    assert f"load {previous['autoscaling']['load']:.1f}" in previous["conditions"][0]["message"]
    gaps = [b - a for a, b in zip(written, written[1:])]
    assert len(written) <= 150 * TICK / LOAD_EVERY_S + 2 and min(gaps) >= LOAD_EVERY_S, written
    # A decision that changes the replicas is written at once.
    samples += [Sample(now + TICK * k, 40.0) for k in range(1, 4)]
    scaling = builtin(isvc, observed, "r1", previous, samples[-30:], now + 3 * TICK, 3)
    assert scaling.replicas > 3 and scaling.status["loadTime"] == iso(now + 3 * TICK)


def test_a_pod_waiting_for_a_node_does_not_make_every_pass_write_status():
    """InsufficientCapacity replaced the decision's reason after the throttle compared them, so
    the next pass saw another reason and wrote again: every 2 s for as long as a pod waited."""
    from kiln.operator.observed import Observed
    from kiln.operator.scaling import LOAD_EVERY_S
    observed = Observed.of(*(pod(name, True) for name in "abc"), pod("d", False, unschedulable=True))
    written, _, previous, _, _ = steady_passes(observed)
    assert previous["conditions"][0]["reason"] == "InsufficientCapacity"
    assert len(written) <= 150 * TICK / LOAD_EVERY_S + 2, written
