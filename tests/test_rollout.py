"""The canary rollout's pure parts: the analysis of router figures (analysis.py), the step
machine (rollout.py) and what desired() makes of a split. No cluster: recorded figures in,
decisions out."""
from __future__ import annotations

from datetime import datetime

import pytest

from kiln.operator.analysis import FAIL, INCONCLUSIVE, PASS, Check, Figures, check, figures, quantile
from kiln.operator.canary import split as split_of
from kiln.operator.desired import Split, desired
from kiln.operator.models import Analysis, InferenceServiceSpec, Rollout
from kiln.operator.observed import Observed, engine_failure
from kiln.operator.plan import plan
from kiln.operator.render import LABEL_REVISION, Owner, revision_name
from kiln.operator.rollout import (FAILED_STARTS, PAUSED, PROGRESSING, PROMOTED, ROLLED_BACK, Decision, Facts, State,
                                  advance, dump, load)
from test_desired import deployment

ROLLOUT = Rollout.model_validate({
    "steps": [{"weight": 20, "pause": "30s"}, {"weight": 50, "pause": "30s"}], "progressDeadline": "2m",
    "analysis": {"interval": "10s", "failureLimit": 2, "minRequests": 5,
                 "quality": {"minGreedyAgreement": 0.95, "minTokens": 20}}})
READY, FULL = Facts(canary_ready=1, canary_full=False), Facts(canary_ready=2, canary_full=True)


def page(revision: str, ok: int, errors: int = 0, ttft: tuple[int, ...] = (), tokens: int = 0, agreed: int = 0):
    """Router samples of one revision: `ttft` counts per bucket (0.1, 0.5, 1, +Inf), made cumulative."""
    yield "kiln_router_requests_total", {"revision": revision, "code": "200"}, ok
    yield "kiln_router_requests_total", {"revision": revision, "code": "503"}, errors
    yield "kiln_router_requests_total", {"revision": revision, "code": "499"}, 7  # never counted
    total = 0
    for le, n in zip(("0.1", "0.5", "1.0", "+Inf"), ttft or (0, 0, 0, 0)):
        total += n
        yield "kiln_router_time_to_first_token_seconds_bucket", {"revision": revision, "le": le}, total
    yield "kiln_router_mirror_tokens_total", {"revision": revision}, tokens
    yield "kiln_router_mirror_agreed_total", {"revision": revision}, agreed


def test_figures_sum_routers_and_leave_client_hang_ups_out():
    found = figures([*page("c", 10, 2, (5, 5, 0, 0)), *page("c", 5, 0, (0, 5, 0, 0))])
    assert (found["c"].requests, found["c"].errors) == (17, 2)
    assert found["c"].ttft == {0.1: 5, 0.5: 15, 1.0: 15, float("inf"): 15}
    # Attempts the canary refused and another replica answered are its requests and its errors.
    retried = figures([*page("c", 10), ("kiln_router_retries_total", {"revision": "c"}, 3)])
    assert (retried["c"].requests, retried["c"].errors) == (13, 3)


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    assert quantile(0.5, {0.1: 0, 0.5: 10, float("inf"): 10}) == pytest.approx(0.3)
    assert quantile(0.95, {0.1: 100, float("inf"): 100}) == pytest.approx(0.095)
    assert quantile(0.95, {1.0: 0, float("inf"): 4}) == 1.0  # beyond the last bound: that bound
    assert quantile(0.95, {}) is None


def test_an_interval_is_the_difference():
    before, after = Figures(requests=100, tokens=50, ttft={1.0: 4}), Figures(requests=130, tokens=70, ttft={1.0: 9})
    delta = after.minus(before)
    assert (delta.requests, delta.tokens, delta.ttft) == (30, 20, {1.0: 5})
    assert not after.fell_below(before) and before.fell_below(after)


def test_check_passes_fails_each_way_and_is_inconclusive_on_few_samples():
    analysis = ROLLOUT.analysis
    stable = figures(page("s", 100, 0, (90, 10, 0, 0), tokens=40, agreed=39))["s"]
    good = figures(page("c", 20, 0, (18, 2, 0, 0), tokens=100, agreed=96))["c"]
    result = check(good, stable, analysis)
    assert result.verdict == PASS and result.figures["greedyAgreement"] == 0.96
    assert result.figures["noiseFloor"] == 0.975  # stable against itself, 40 tokens >= minTokens
    errors = figures(page("c", 18, 2, (18, 2, 0, 0), tokens=100, agreed=96))["c"]
    assert check(errors, stable, analysis).failed == ["error rate 0.100 > 0.01"]
    slow = figures(page("c", 20, 0, (0, 0, 20, 0), tokens=100, agreed=96))["c"]
    assert check(slow, stable, analysis).failed[0].startswith("TTFT p95 ratio")
    # 0.92 < 0.95 x 0.975: the gate is relative to the noise floor.
    worse = figures(page("c", 20, 0, (18, 2, 0, 0), tokens=100, agreed=92))["c"]
    failed = check(worse, stable, analysis)
    assert failed.verdict == FAIL and "greedy agreement 0.920 < 0.926" in failed.failed[0]
    assert check(figures(page("c", 4, 0, tokens=100, agreed=0))["c"], stable, analysis).verdict == INCONCLUSIVE
    assert check(figures(page("c", 50, 0, tokens=10, agreed=0))["c"], stable, analysis).verdict == INCONCLUSIVE
    no_floor = figures(page("s", 100, 0, tokens=5, agreed=5))["s"]
    assert check(worse, no_floor, analysis).figures["noiseFloor"] is None  # too few: 1.0 stands in
    assert check(worse, no_floor, Analysis(minRequests=5)).verdict == PASS  # no quality gate
    # A stable replica dying (its requests failing) never counts against the canary.
    dying = figures(page("s", 50, 50, (90, 10, 0, 0), tokens=40, agreed=39))["s"]
    assert check(good, dying, analysis).verdict == PASS


def test_the_error_rate_is_judged_beside_the_stable_revisions():
    """One 5xx in 10 failed a check at the default maxErrorRate even when stable failed as often
    (a prompt no model answers, a shared dependency down): what stable fails is no regression, but
    no evidence for the canary either: inconclusive."""
    analysis = Analysis()  # minRequests 10, maxErrorRate 0.01
    one_in_ten = figures(page("c", 9, 1))["c"]
    as_often = figures(page("s", 81, 9))["s"]
    result = check(one_in_ten, as_often, analysis)
    assert result.verdict == INCONCLUSIVE and not result.failed and result.figures["stableErrorRate"] == 0.1
    # Nor does failing every request beside a stable revision that does too (a shared outage) pass it.
    assert check(figures(page("c", 0, 50))["c"], figures(page("s", 0, 500))["s"], analysis).verdict == INCONCLUSIVE
    assert check(one_in_ten, figures(page("s", 900, 0))["s"], Analysis(maxErrorRate=0.2)).verdict == PASS
    clean = figures(page("s", 90, 0))["s"]
    assert check(one_in_ten, clean, analysis).failed == ["error rate 0.100 > 0.01"]  # the old threshold
    # Past maxErrorRate above stable's share is still a failure, said with both figures.
    worse = check(figures(page("c", 7, 3))["c"], as_often, analysis)
    assert worse.verdict == FAIL and worse.failed == ["error rate 0.300 > 0.01 + stable's 0.100"]
    # Stable with fewer than minRequests answers (a 100% step) is no baseline: the threshold is absolute.
    few = check(one_in_ten, figures(page("s", 5, 4))["s"], analysis)
    assert few.verdict == FAIL and few.figures["stableErrorRate"] is None


def test_a_latency_ratio_needs_min_requests_streamed_on_each_side():
    """One slow stream among fifty answers is no p95: the ratio is left unjudged, not failed."""
    analysis = ROLLOUT.analysis  # minRequests 5
    stable = figures(page("s", 400, 0, (390, 10, 0, 0), tokens=40, agreed=39))["s"]
    one_slow = figures(page("c", 50, 0, (0, 0, 1, 0), tokens=100, agreed=96))["c"]
    result = check(one_slow, stable, analysis)
    assert result.verdict == PASS and result.figures["ttftP95Ratio"] is None
    few_stable = figures(page("s", 400, 0, (1, 0, 0, 0), tokens=40, agreed=39))["s"]
    slow = figures(page("c", 20, 0, (0, 0, 20, 0), tokens=100, agreed=96))["c"]
    assert check(slow, few_stable, analysis).figures["ttftP95Ratio"] is None
    assert check(slow, stable, analysis).verdict == FAIL  # both sides streamed enough


def verdict(v: str) -> Check:
    return Check(v, {"canaryRequests": 10, "greedyAgreement": 0.5}, ["greedy agreement 0.500 < 0.950"] if v == FAIL else [])


def run(state: State | None, target: str, facts: Facts, check_: Check | None, now: float):
    return advance(ROLLOUT, state, "stable-a", target, facts, check_, now)


def test_a_rollout_starts_waits_for_readiness_steps_and_promotes():
    d = run(None, "canary-b", Facts(0, False), None, 0)
    assert (d.state.phase, d.canary, d.state.step, d.weight(ROLLOUT)) == (PROGRESSING, "canary-b", 0, 0)
    assert [e.reason for e in d.events] == ["RolloutStarted"]
    d = run(d.state, "canary-b", Facts(0, False), None, 60)  # still loading, inside the deadline
    assert d.state.step == 0 and "waiting" in d.state.message
    d = run(d.state, "canary-b", READY, None, 70)
    assert (d.state.step, d.weight(ROLLOUT)) == (1, 20)
    d = run(d.state, "canary-b", READY, verdict(INCONCLUSIVE), 110)  # the pause is over, nothing judged yet
    assert d.state.step == 1
    d = run(d.state, "canary-b", READY, verdict(PASS), 115)
    assert (d.state.step, d.weight(ROLLOUT)) == (2, 50)
    d = run(d.state, "canary-b", READY, verdict(PASS), 150)
    assert d.full_size(ROLLOUT) and d.weight(ROLLOUT) == 50  # scaled up before promotion
    d = run(d.state, "canary-b", READY, None, 160)
    assert d.state.phase == PROGRESSING  # not all its replicas are ready yet
    d = run(d.state, "canary-b", FULL, None, 170)
    assert (d.state.phase, d.state.stable, d.canary) == (PROMOTED, "canary-b", None)
    assert "canary-b promoted" in d.state.message
    # Promoted: the spec's revision is stable; nothing more happens.
    assert advance(ROLLOUT, d.state, "canary-b", "canary-b", FULL, None, 500).state == d.state


def test_failed_checks_roll_back_and_the_same_revision_is_not_retried_until_asked():
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    d = run(d.state, "canary-b", READY, verdict(FAIL), 20)
    assert d.state.phase == PROGRESSING and d.state.failed == 1
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "AnalysisFailed")]
    d = run(d.state, "canary-b", READY, verdict(FAIL), 30)
    assert (d.state.phase, d.canary, d.state.rolled_back, d.weight(ROLLOUT)) == (ROLLED_BACK, None, "canary-b", 0)
    assert "greedy agreement 0.500 < 0.950" in d.state.message and "stable-a serves 100%" in d.state.message
    again = run(d.state, "canary-b", READY, None, 40)
    assert again.state == d.state  # the spec is unchanged: no new rollout
    retried = run(d.state, "canary-b", Facts(0, False, retry_token="1"), None, 50)
    assert (retried.state.phase, retried.canary, retried.state.retry_token) == (PROGRESSING, "canary-b", "1")
    assert run(d.state, "canary-c", READY, None, 60).canary == "canary-c"  # another change: a new rollout
    # The spec went back to stable, and later asks for canary-b again: that is a new rollout.
    reverted = run(d.state, "stable-a", READY, None, 70)
    assert (reverted.state.phase, reverted.state.rolled_back) == (ROLLED_BACK, None)
    assert run(reverted.state, "canary-b", READY, None, 3600).canary == "canary-b"


def test_a_failed_check_never_moves_traffic_on_in_the_same_pass():
    # A pass earlier in the step, then a failure (one of two allowed) with the pause over: it
    # went from 20% to 50% along with its AnalysisFailed event.
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    d = run(d.state, "canary-b", READY, verdict(PASS), 11)
    d = run(d.state, "canary-b", READY, verdict(FAIL), 50)
    assert (d.state.step, d.weight(ROLLOUT), [e.reason for e in d.events]) == (1, 20, ["AnalysisFailed"])
    d = run(d.state, "canary-b", READY, verdict(PASS), 60)  # a pass after the failure carries it on
    assert d.state.step == 2
    # Nor is a canary promoted at full size in a pass whose check failed.
    d = run(d.state, "canary-b", READY, verdict(PASS), 100)
    assert d.full_size(ROLLOUT)
    failed_rollout = ROLLOUT.model_copy(update={"analysis": ROLLOUT.analysis.model_copy(update={"failureLimit": 3})})
    held = advance(failed_rollout, d.state, "stable-a", "canary-b", FULL, verdict(FAIL), 110)
    assert held.state.phase == PROGRESSING and held.canary == "canary-b"


def test_a_canary_that_never_gets_ready_is_rolled_back_after_the_deadline():
    d = run(None, "canary-b", Facts(0, False), None, 0)
    d = run(d.state, "canary-b", Facts(0, False), None, 121)
    assert d.state.phase == ROLLED_BACK and "progressDeadline" in d.state.message


def test_a_canary_whose_engine_keeps_failing_to_start_is_rolled_back_at_once():
    """Before the deadline, as soon as a canary engine failed FAILED_STARTS times, quoting why."""
    crashed = {"ready": False, "restartCount": FAILED_STARTS - 1, "lastState": {"terminated": {
        "exitCode": 2, "reason": "Error", "message": "2026-11-27 17:20:55 ERROR kiln.serve: bad configuration"}}}
    pods = [{"metadata": {"name": "canary-b-1"}, "status": {"containerStatuses": [crashed]}}]
    assert engine_failure(pods, FAILED_STARTS) is None  # two failed starts: may yet load
    d = run(None, "canary-b", Facts(0, False, failing=engine_failure(pods, FAILED_STARTS)), None, 0)
    assert d.state.phase == PROGRESSING
    crashed["restartCount"] = FAILED_STARTS
    d = run(d.state, "canary-b", Facts(0, False, failing=engine_failure(pods, FAILED_STARTS)), None, 30)
    assert (d.state.phase, d.state.rolled_back) == (ROLLED_BACK, "canary-b")
    assert ("its engine failed to start 3 times (pod canary-b-1: the engine exited with code 2 (Error): ERROR "
            "kiln.serve: bad configuration)") in d.state.message


def test_a_spec_change_mid_rollout_restarts_with_the_newest_and_a_revert_drops_the_canary():
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    assert d.state.step == 1
    d = run(d.state, "canary-c", READY, None, 5)
    assert (d.canary, d.state.step, d.state.since) == ("canary-c", 0, 5)
    reverted = run(d.state, "stable-a", READY, None, 6)
    assert (reverted.state.phase, reverted.canary, reverted.state.rolled_back) == (ROLLED_BACK, None, None)


def test_a_step_without_pause_holds_until_resumed():
    rollout = ROLLOUT.model_copy(update={"steps": [ROLLOUT.steps[0].model_copy(update={"pause": None})]})
    d = advance(rollout, None, "a", "b", READY, None, 0)
    d = advance(rollout, d.state, "a", "b", READY, None, 1)
    d = advance(rollout, d.state, "a", "b", READY, verdict(PASS), 500)
    assert d.state.phase == PAUSED and "kiln.dev/resume-rollout" in d.state.message
    d = advance(rollout, d.state, "a", "b", Facts(1, False, resume_token="go"), None, 501)
    assert d.full_size(rollout)


def test_a_timed_step_with_only_inconclusive_checks_says_so_and_goes_on_when_resumed():
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    d = run(d.state, "canary-b", READY, verdict(INCONCLUSIVE), 20)
    assert d.state.step == 1 and "pause is over" not in d.state.message
    d = run(d.state, "canary-b", READY, verdict(INCONCLUSIVE), 40)  # the 30s pause is over: no pass yet
    assert (d.state.phase, d.state.step) == (PROGRESSING, 1)
    assert "the pause is over but no analysis interval has passed" in d.state.message
    assert "kiln.dev/resume-rollout" in d.state.message
    d = run(d.state, "canary-b", Facts(1, False, resume_token="go"), None, 41)
    assert (d.state.step, d.state.resume_token) == (2, "go")
    d = run(d.state, "canary-b", Facts(1, False, resume_token="go"), None, 80)  # consumed: no skip
    assert d.state.step == 2


def test_state_survives_status_round_trip_so_a_restarted_operator_resumes_the_same_step():
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    d = run(d.state, "canary-b", READY, verdict(FAIL), 20)
    saved = dump(d.state, ROLLOUT)
    assert saved["mirror"] == {"sampleRate": 0.05, "floorSampleRate": 0.25}
    restored = load(saved)
    assert (restored.step, restored.failed, restored.since, restored.canary) == (1, 1, 1, "canary-b")
    assert restored.analysis["greedyAgreement"] == 0.5


def spec_of(quantization: str) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": {"source": "builtin://smollm2-135m"}, "replicas": 4,
        "engine": {"quantization": quantization}, "rollout": ROLLOUT.model_dump()})


def ready_pod(revision: str, name: str) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "labels": {"kiln.dev/component": "engine",
                                                                 LABEL_REVISION: revision}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def epoch_of(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_desired_keeps_the_stable_revision_as_it_is_and_sizes_the_canary_by_weight():
    owner = Owner("chat", "ns", "uid")
    stable, canary = revision_name("chat", spec_of("none")), revision_name("chat", spec_of("int8"))
    old_spec = desired(owner, spec_of("none"), Observed(), "img").stable.deployment
    observed = Observed.of(old_spec)
    want = desired(owner, spec_of("int8"), observed, "img", split=Split(stable, canary, 20))
    roles = [(r.name, r.role, r.replicas, r.weight, r.deployment is None) for r in want.revisions]
    assert roles == [(stable, "stable", 4, 100, True), (canary, "canary", 1, 0, False)]  # none ready yet
    ready_one = Observed.of(old_spec, ready_pod(canary, "c1"))
    want = desired(owner, spec_of("int8"), ready_one, "img", split=Split(stable, canary, 20))
    roles = [(r.name, r.role, r.replicas, r.weight, r.deployment is None) for r in want.revisions]
    assert roles == [(stable, "stable", 4, 80, True), (canary, "canary", 1, 20, False)]
    # Sized for 4 at a 100% step: the share follows the ready replicas, and none leaves it all to stable.
    for ready, weight in ((0, 0), (1, 25), (3, 75), (4, 100)):
        pods = [ready_pod(canary, f"c{i}") for i in range(ready)]
        full = desired(owner, spec_of("int8"), Observed.of(old_spec, *pods), "img",
                       split=Split(stable, canary, 100, full_size=True))
        assert [(r.replicas, r.weight) for r in full.revisions] == [(4, 100 - weight), (4, weight)]
    # A stable revision scaled to zero: the canary keeps one replica, or it could never be promoted.
    at_zero = spec_of("int8").model_copy(update={"replicas": 0})
    for at_zero_split in (Split(stable, canary, 20), Split(stable, canary, 50, full_size=True)):
        want = desired(owner, at_zero, observed, "img", split=at_zero_split)
        assert [(r.role, r.replicas) for r in want.revisions] == [("stable", 0), ("canary", 1)]
    rolled_back = desired(owner, spec_of("int8"), observed, "img", split=Split(stable))
    assert [(r.role, r.weight) for r in rolled_back.revisions] == [("stable", 100)]


def test_a_dropped_canary_goes_at_once_even_while_the_stable_revision_is_short():
    # Stable asked 4, 3 ready (a pod with no GPU free, the failed canary holding them): the
    # rolled-back canary was kept as an old revision, at full size, until stable was ready.
    owner = Owner("chat", "ns", "uid")
    stable, canary = revision_name("chat", spec_of("none")), revision_name("chat", spec_of("int8"))
    observed = Observed.of(deployment(stable, ready=3, replicas=4), deployment(canary, ready=4, replicas=4))
    decision = Decision(State(ROLLED_BACK, stable, rolled_back=canary))
    want = desired(owner, spec_of("int8"), observed, "img", split=split_of(spec_of("int8"), decision))
    assert [r.name for r in want.revisions] == [stable]
    assert ("delete", canary) in [(a.verb, a.name) for a in plan(want, observed) if a.kind == "Deployment"]
    # Without a rollout's end behind it, an old revision still waits for the new one to be whole.
    replaced = desired(owner, spec_of("int4").model_copy(update={"rollout": None}), observed, "img")
    assert {r.name for r in replaced.revisions} == {revision_name("chat", spec_of("int4")), stable, canary}


def test_status_patch_removes_keys_dropped_at_any_depth():
    from kiln.operator.reconcile import merge_patch
    before = {"rollout": {"phase": "Progressing", "canary": "b", "analysis": {"errorRate": 0.1}}, "url": "u"}
    after = {"rollout": {"phase": "RolledBack", "analysis": {}}}
    assert merge_patch(before, after) == {"url": None, "rollout": {"phase": "RolledBack", "canary": None,
                                                                   "analysis": {"errorRate": None}}}


def test_a_canary_failing_every_request_fails_even_with_no_mirrored_tokens():
    # Failed requests score no tokens: too few tokens leaves quality unjudged, never the errors.
    stable = figures(page("s", 100, 0, tokens=40, agreed=39))["s"]
    failing = figures(page("c", 0, 20))["c"]
    result = check(failing, stable, ROLLOUT.analysis)
    assert result.verdict == FAIL and result.failed == ["error rate 1.000 > 0.01"]
    # Healthy but too few tokens: still inconclusive; exactly at maxErrorRate is no failure.
    assert check(figures(page("c", 99, 1, tokens=10))["c"], stable, ROLLOUT.analysis).verdict == INCONCLUSIVE
    assert check(figures(page("c", 99, 1))["c"], stable, Analysis(minRequests=5)).verdict == PASS


def test_a_canary_whose_every_stream_stalls_fails_on_latency_with_no_request_answered():
    """Clients that give up on a stalled stream are 499s, no answers, but their waits are timed:
    with none answered the check returned inconclusive before it looked at them, and a hung
    canary kept its step's share of requests for ever, never failed."""
    stable = figures(page("s", 100, 0, (90, 10, 0, 0)))["s"]
    stalled = figures(page("c", 0, 0, (0, 0, 0, 20)))["c"]  # 20 waits past the last bound, all 499s
    result = check(stalled, stable, ROLLOUT.analysis)
    assert result.verdict == FAIL and result.failed[0].startswith("TTFT p95 ratio")
    # Too few answers and too few streams is still no verdict.
    assert check(figures(page("c", 0, 0, (0, 0, 0, 4)))["c"], stable, ROLLOUT.analysis).verdict == INCONCLUSIVE


def test_nan_counts_are_no_figures_and_never_pass_the_quality_gate():
    stable = figures(page("s", 100, 0, tokens=40, agreed=39))["s"]
    for tokens, agreed in ((float("nan"), float("nan")), (100, float("nan")), (float("inf"), 100)):
        result = check(figures(page("c", 20, 0, tokens=tokens, agreed=agreed))["c"], stable, ROLLOUT.analysis)
        assert result.verdict != PASS


def test_the_progress_deadline_runs_from_losing_readiness_not_from_the_steps_start():
    rollout = ROLLOUT.model_copy(update={"steps": [ROLLOUT.steps[0].model_copy(update={"pause": "1h"})]})
    d = advance(rollout, None, "a", "b", READY, None, 0)
    d = advance(rollout, d.state, "a", "b", READY, None, 10)
    assert d.state.step == 1
    # 16 minutes into the hour-long step its one pod restarts: not a rollback on the spot.
    d = advance(rollout, d.state, "a", "b", Facts(0, False, unready_since=995), None, 1000)
    assert d.state.phase == PROGRESSING and "ready replica again" in d.state.message
    # Still none ready the deadline (2m) after it went: rolled back.
    d = advance(rollout, d.state, "a", "b", Facts(0, False, unready_since=995), None, 995 + 121)
    assert d.state.phase == ROLLED_BACK and "progressDeadline" in d.state.message


def test_a_pending_replacement_pod_is_not_a_rollback_on_the_spot():
    """An evicted canary pod's replacement waits for a node: it has no Ready condition, so the
    pods tell no time. The deadline runs from the first pass that saw no ready replica, kept in
    status across an operator restart, and starts anew once the canary is ready again."""
    rollout = ROLLOUT.model_copy(update={"steps": [ROLLOUT.steps[0].model_copy(update={"pause": "1h"})]})
    d = advance(rollout, None, "a", "b", READY, None, 0)
    d = advance(rollout, d.state, "a", "b", READY, None, 10)
    pending = Facts(0, False, unready_since=None)
    d = advance(rollout, d.state, "a", "b", pending, None, 1200)  # 20 minutes into the step
    assert d.state.phase == PROGRESSING and "ready replica again" in d.state.message
    restarted = load(dump(d.state, rollout))  # an operator restart in between
    d = advance(rollout, restarted, "a", "b", pending, None, 1200 + 110)
    assert d.state.phase == PROGRESSING
    d = advance(rollout, d.state, "a", "b", READY, None, 1200 + 115)  # back: the clock stops
    assert d.state.unready_since is None and "canaryUnreadySince" not in dump(d.state, rollout)
    d = advance(rollout, d.state, "a", "b", pending, None, 1400)
    assert d.state.phase == PROGRESSING
    d = advance(rollout, d.state, "a", "b", pending, None, 1400 + 121)
    assert d.state.phase == ROLLED_BACK and "progressDeadline" in d.state.message


def test_unready_since_is_the_latest_ready_transition_of_the_pods():
    from kiln.operator.canary import last_ready_turn

    def unready_since(pods: list[dict]) -> float | None:
        return last_ready_turn(pods, "False")

    def pod(at: str) -> dict:
        return {"metadata": {"name": at}, "status": {"conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:09:00Z"},
            {"type": "Ready", "status": "False", "lastTransitionTime": at}]}}
    assert unready_since([pod("2026-01-01T00:01:00Z"), pod("2026-01-01T00:02:00Z")]) == 1767225720.0
    # The Kubernetes client hands stored times back as `+00:00`, not `Z`: a real pod's condition.
    assert unready_since([pod("2026-01-01T00:02:00+00:00")]) == 1767225720.0
    assert unready_since([{"metadata": {"name": "new"}, "status": {}}]) is None
    # Evicted: still Ready=True since it started, hours before the step; and one Ready an hour ago.
    evicted = {"metadata": {"name": "old", "deletionTimestamp": "2026-01-01T05:00:30Z"}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:01:00Z"}]}}
    assert unready_since([evicted]) is None and unready_since([pod("2026-01-01T00:02:00Z"), evicted]) == 1767225720.0
    # Its turn to True is a replica added (a canary scaling up), unless the pod is going.
    assert last_ready_turn([pod("2026-01-01T00:02:00Z"), dict(evicted, metadata={"name": "up"})], "True") \
        == epoch_of("2026-01-01T00:01:00Z")
    assert last_ready_turn([pod("2026-01-01T00:02:00Z"), evicted], "True") is None
    rollout = Rollout.model_validate({"steps": [{"weight": 10, "pause": "1h"}], "progressDeadline": "2m"})
    d = advance(rollout, State(PROGRESSING, "a", "b", 1, since=epoch_of("2026-01-01T04:00:00Z")), "a", "b",
                Facts(canary_ready=0, canary_full=False, unready_since=unready_since([evicted])), None,
                epoch_of("2026-01-01T05:00:01Z"))
    assert d.state.phase == PROGRESSING and d.state.unready_since == epoch_of("2026-01-01T05:00:01Z")


def test_an_interval_is_taken_router_by_router():
    """Two routers; b's 15 canary errors belong to an interval already judged. b missing from
    one scrape (slow, not ready) made the sums drop, read as a counter reset: the lifetime
    counts became the interval's, and b's old errors failed a clean interval when it came back."""
    from kiln.operator.canary import interval

    def router(ok: int, errors: int = 0) -> dict:
        return figures([*page("canary", ok, errors), *page("stable", 4 * ok)])
    base = {"a": router(500), "b": router(480, 15)}
    one = {"a": router(540)}  # b not scraped: nothing of it counts
    two = {"a": router(560), "b": router(500, 15)}  # b back, 20 more requests, no new error
    assert interval(one, base, "canary").requests == 40
    canary, stable = interval(two, one, "canary"), interval(two, one, "stable")
    assert (canary.requests, canary.errors, stable.requests) == (20, 0, 80)
    assert check(canary, stable, ROLLOUT.analysis).verdict != FAIL  # inconclusive: nothing mirrored
    # A router that restarted (its counters went down) counts from zero, the others as they grew.
    restarted = {"a": router(600), "b": router(7, 1)}
    assert (interval(restarted, two, "canary").requests, interval(restarted, two, "canary").errors) == (48, 1)
    assert interval(two, base, "canary").ttft == {0.1: 0, 0.5: 0, 1.0: 0, float("inf"): 0}
    # An old revision retired since (its series dropped by the router) is no restart: the interval
    # stays the increase, not the lifetime counts. The judged revision's own series gone is one.
    with_old = {"a": {**router(560), **figures(page("old", 900, 30))}}
    retired = {"a": router(590)}
    assert interval(retired, with_old, "canary").requests == 30
    assert interval(retired, with_old, "stable").requests == 120
    assert interval({"a": figures(page("stable", 10))}, with_old, "canary").requests == 0  # restarted, none since


def test_a_restarted_router_counts_from_zero_all_at_once():
    """Judged counter by counter, the requests that had climbed back past their old count gave an
    increase of 20 beside a lifetime's 4 errors, and tokens beside the increase of agreed ones:
    a false Fail of a healthy canary."""
    from kiln.operator.canary import interval
    before = {"r": {"c": Figures(requests=100, errors=5, tokens=1000, agreed=950)}}
    after = {"r": {"c": Figures(requests=120, errors=4, tokens=990, agreed=960)}}
    got = interval(after, before, "c")
    assert (got.requests, got.errors, got.tokens, got.agreed) == (120, 4, 990, 960)
    # One revision's counter going down restarts the others' of the same router too.
    before["r"]["s"], after["r"]["s"] = Figures(requests=50), Figures(requests=3)
    assert interval(after, before, "c").requests == 120
    assert interval({"r": {"c": Figures(requests=130, errors=5, ttft={1.0: 9})}},
                    {"r": {"c": Figures(requests=100, errors=5, ttft={1.0: 10})}}, "c").requests == 130


def test_an_ended_rollout_leaves_no_baseline_for_the_next_one_of_the_same_revision():
    from kiln.operator.canary import Baseline, roll
    owner, key = Owner("chat", "ns", "uid"), ("ns", "chat")
    stable, canary = revision_name("chat", spec_of("none")), revision_name("chat", spec_of("int8"))
    observed = Observed.of(desired(owner, spec_of("none"), Observed(), "img").stable.deployment)
    previous = {"rollout": dump(State(PROGRESSING, stable, canary, step=1, since=0), ROLLOUT)}
    # Its errors before the abort must not be judged in the first interval of a re-apply.
    baselines = {key: Baseline(50, canary, {"router-uid": {canary: Figures(requests=20, errors=20)}})}
    kept = roll(owner, spec_of("int8"), observed, {}, previous, baselines, 60)
    assert kept.state.phase == PROGRESSING and key in baselines
    aborted = roll(owner, spec_of("none"), observed, {}, previous, baselines, 70)
    assert aborted.state.phase == ROLLED_BACK and key not in baselines
    # Nor the requests of an attempt that another spec replaced before the same canary came back.
    other = revision_name("chat", spec_of("int4"))
    baselines[key] = Baseline(50, canary, {"router-uid": {canary: Figures(requests=20, errors=20)}})
    replaced = roll(owner, spec_of("int4"), observed, {}, previous, baselines, 55)
    assert replaced.state.canary == other and key not in baselines


def test_a_fail_in_the_scale_up_step_holds_promotion_until_a_check_passes():
    """The Fail blocked promotion in its own pass only: the next pass promoted a canary whose
    newest verdict was Fail."""
    d = run(None, "canary-b", READY, None, 0)
    for now, check_ in ((1, None), (40, verdict(PASS)), (80, verdict(PASS))):
        d = run(d.state, "canary-b", READY, check_, now)
    assert d.full_size(ROLLOUT)
    d = run(d.state, "canary-b", FULL, verdict(FAIL), 90)
    assert d.state.phase == PROGRESSING and d.state.failed == 1
    d = run(d.state, "canary-b", FULL, None, 91)
    assert d.state.phase == PROGRESSING and d.canary == "canary-b"
    assert "a failed check holds promotion" in d.state.message
    # Too little data to judge is no pass: the hold stays, across an operator restart too.
    d = run(load(dump(d.state, ROLLOUT)), "canary-b", FULL, verdict(INCONCLUSIVE), 95)
    assert d.state.phase == PROGRESSING and "a failed check holds promotion" in d.state.message
    d = run(d.state, "canary-b", FULL, verdict(PASS), 100)
    assert d.state.phase == PROMOTED
    # With no check to come (routers that cannot be scraped), a person may promote it anyway.
    held = run(run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1).state,
               "canary-b", READY, None, 2)
    for now, check_ in ((40, verdict(PASS)), (80, verdict(PASS)), (90, verdict(FAIL)), (91, None)):
        held = run(held.state, "canary-b", FULL if now >= 90 else READY, check_, now)
    assert held.state.phase == PROGRESSING
    resumed = run(held.state, "canary-b", Facts(2, True, resume_token="go"), None, 92)
    assert resumed.state.phase == PROMOTED and resumed.state.resume_token == "go"


def test_a_canary_that_never_reaches_full_size_is_rolled_back_after_the_deadline():
    """Ready but short of the stable revision's size (its pods unschedulable while the stable
    revision holds the GPUs): waiting for ever would keep those pods and their GPUs."""
    d = run(None, "canary-b", READY, None, 0)
    for now, check_ in ((1, None), (40, verdict(PASS)), (80, verdict(PASS))):
        d = run(d.state, "canary-b", READY, check_, now)
    assert d.full_size(ROLLOUT)
    d = run(d.state, "canary-b", READY, verdict(PASS), 150)  # 70 s into the scale-up step: waits
    assert d.state.phase == PROGRESSING and "scaling canary" in d.state.message
    d = run(d.state, "canary-b", READY, None, 201)  # past progressDeadline (2m) since the step began
    assert d.state.phase == ROLLED_BACK and "did not reach the stable revision's size" in d.state.message


def test_a_canary_still_gaining_replicas_is_not_rolled_back_while_the_stable_revision_grows():
    """Rising load autoscales the stable revision up for the whole scale-up step, so the size
    the canary must reach keeps moving: the deadline runs from its last new ready replica."""
    d = run(None, "canary-b", READY, None, 0)
    for now, check_ in ((1, None), (40, verdict(PASS)), (80, verdict(PASS))):
        d = run(d.state, "canary-b", READY, check_, now)
    assert d.full_size(ROLLOUT)
    for now in (150, 250, 350):  # a canary replica became ready a minute before each pass
        d = run(d.state, "canary-b", Facts(2, False, became_ready=now - 60), None, now)
        assert d.state.phase == PROGRESSING, now
    d = run(d.state, "canary-b", Facts(3, True, became_ready=340), verdict(PASS), 360)
    assert d.state.phase == PROMOTED
    # No new ready replica for progressDeadline (2m): rolled back, as before.
    stuck = run(None, "canary-b", READY, None, 0)
    for now, check_ in ((1, None), (40, verdict(PASS)), (80, verdict(PASS))):
        stuck = run(stuck.state, "canary-b", READY, check_, now)
    stuck = run(stuck.state, "canary-b", Facts(2, False, became_ready=150), None, 271)
    assert stuck.state.phase == ROLLED_BACK and "no replica became ready for 2m" in stuck.state.message


def test_an_unready_time_ahead_of_the_operators_clock_is_stored_as_now():
    """A node clock ahead stored a future unreadySince, which put the deadline off by the skew."""
    rollout = Rollout.model_validate({"steps": [{"weight": 10, "pause": "1h"}], "progressDeadline": "2m"})
    d = advance(rollout, State(PROGRESSING, "a", "b", 1, since=0), "a", "b",
                Facts(canary_ready=0, canary_full=False, unready_since=5000), None, 100)
    assert d.state.unready_since == 100
    d = advance(rollout, d.state, "a", "b", Facts(canary_ready=0, canary_full=False, unready_since=5000), None, 221)
    assert d.state.phase == ROLLED_BACK


def test_before_promotion_a_crash_loop_rolls_back():
    """A replica crash-looping (ready between its crashes) kept pushing the deadline of a canary
    short of full size back."""
    d = run(None, "canary-b", READY, None, 0)
    for now, check_ in ((1, None), (40, verdict(PASS)), (80, verdict(PASS))):
        d = run(d.state, "canary-b", READY, check_, now)
    crashing = run(d.state, "canary-b", Facts(2, False, became_ready=95, failing="pod b-2: the engine exited"),
                   None, 100)
    assert crashing.state.phase == ROLLED_BACK and "failed to start" in crashing.state.message


def test_a_resume_asked_for_before_a_step_begins_does_not_skip_that_step():
    """The annotation set while the canary loads was read by no step: the next pass skipped
    step 1 without a check."""
    d = run(None, "canary-b", Facts(0, False), None, 0)
    d = run(d.state, "canary-b", Facts(0, False, resume_token="go"), None, 5)  # still loading
    d = run(d.state, "canary-b", Facts(1, False, resume_token="go"), None, 10)
    assert d.state.step == 1
    d = run(d.state, "canary-b", Facts(1, False, resume_token="go"), None, 12)
    assert d.state.step == 1 and d.weight(ROLLOUT) == 20


def test_a_retry_asked_for_mid_rollout_does_not_rerun_the_canary_it_rolls_back():
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    annotated = Facts(canary_ready=1, canary_full=False, retry_token="1")
    d = run(d.state, "canary-b", annotated, verdict(FAIL), 20)
    d = run(d.state, "canary-b", annotated, verdict(FAIL), 30)
    assert d.state.phase == ROLLED_BACK
    assert run(d.state, "canary-b", annotated, None, 40).state == d.state  # no new rollout
    assert run(d.state, "canary-b", Facts(0, False, retry_token="2"), None, 50).canary == "canary-b"


def test_each_step_takes_its_own_baseline():
    """A step's first check measured mostly the step before (another weight): the baseline
    was only taken again when a rollout started or ended."""
    from kiln.operator.canary import Baseline, roll
    owner, key = Owner("chat", "ns", "uid"), ("ns", "chat")
    stable, canary = revision_name("chat", spec_of("none")), revision_name("chat", spec_of("int8"))
    observed = Observed.of(desired(owner, spec_of("none"), Observed(), "img").stable.deployment,
                           ready_pod(canary, "canary-0"))
    previous = {"rollout": dump(State(PROGRESSING, stable, canary, step=1, since=0, passed=1), ROLLOUT)}
    baselines = {key: Baseline(35, canary, {"router-uid": {canary: Figures(requests=20)}})}
    d = roll(owner, spec_of("int8"), observed, {}, previous, baselines, 40)  # the pause is over
    assert d.state.step == 2 and key not in baselines


def test_removing_the_resume_annotation_skips_no_gate():
    """`kubectl annotate isvc x kiln.dev/resume-rollout-` read as a new token (None): it moved a
    timed step on without a passing check, an untimed one past its pause, and promoted a held
    canary. Nor does an emptied one (`resume-rollout=`) ask for anything."""
    d = run(None, "canary-b", Facts(0, False, resume_token="go"), None, 0)
    d = run(d.state, "canary-b", Facts(1, False, resume_token="go"), None, 1)
    for token in (None, ""):  # removed, emptied
        d = run(d.state, "canary-b", Facts(1, False, resume_token=token), None, 5)
        assert (d.state.step, d.state.resume_token) == (1, None)
    d = run(d.state, "canary-b", Facts(1, False, resume_token="go"), None, 6)  # set again, to its old value
    assert (d.state.step, d.state.resume_token) == (2, "go")
    untimed = ROLLOUT.model_copy(update={"steps": [ROLLOUT.steps[0].model_copy(update={"pause": None})]})
    paused = State(PAUSED, "a", "b", 1, since=0, resume_token="go")
    held = State(PROGRESSING, "a", "b", 2, since=0, held=True, resume_token="go")
    for token in (None, ""):
        still = advance(untimed, paused, "a", "b", Facts(1, False, resume_token=token), None, 10)
        assert (still.state.phase, still.state.step) == (PAUSED, 1)
        promoted = advance(untimed, held, "a", "b", Facts(2, True, resume_token=token), None, 10)
        assert promoted.state.phase == PROGRESSING


def test_removing_the_retry_annotation_does_not_retry_a_rollback():
    annotated = Facts(canary_ready=1, canary_full=False, retry_token="1")
    d = run(run(None, "canary-b", annotated, None, 0).state, "canary-b", annotated, None, 1)
    d = run(run(d.state, "canary-b", annotated, verdict(FAIL), 20).state, "canary-b", annotated, verdict(FAIL), 30)
    assert (d.state.phase, d.state.retry_token) == (ROLLED_BACK, "1")
    removed = run(d.state, "canary-b", READY, None, 40)
    assert (removed.state.phase, removed.canary, removed.state.retry_token) == (ROLLED_BACK, None, None)
    assert run(d.state, "canary-b", Facts(1, False, retry_token=""), None, 40).state == removed.state  # emptied
    assert run(removed.state, "canary-b", annotated, None, 50).canary == "canary-b"  # set again: a retry


def test_a_retry_is_not_rolled_back_for_the_old_canarys_terminating_pod():
    """Right after a crash-loop rollback the old canary pod is still terminating: its restarts
    and OOMKilled exit rolled the retried canary back at once."""
    old = {"metadata": {"name": "canary-b-old", "deletionTimestamp": "2026-01-01T00:00:00Z"},
           "status": {"containerStatuses": [{"ready": False, "restartCount": FAILED_STARTS, "lastState": {
               "terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}
    new = {"metadata": {"name": "canary-b-new"}, "status": {"containerStatuses": [{"ready": False, "restartCount": 0}]}}
    failing = engine_failure([old, new], FAILED_STARTS)
    assert failing is None
    d = run(State(ROLLED_BACK, "stable-a", rolled_back="canary-b"), "canary-b",
            Facts(0, False, retry_token="1"), None, 0)
    d = run(d.state, "canary-b", Facts(0, False, retry_token="1", failing=failing), None, 5)
    assert (d.state.phase, d.canary) == (PROGRESSING, "canary-b")


def test_a_spec_back_to_a_rolled_back_revision_mid_rollout_leaves_it_rolled_back():
    """B rolled back, the spec to C, then back to B while C ran: B started again, unasked."""
    from kiln.operator.status import canary_condition
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    d = run(run(d.state, "canary-b", READY, verdict(FAIL), 20).state, "canary-b", READY, verdict(FAIL), 30)
    assert (d.state.phase, d.state.rolled_back) == (ROLLED_BACK, "canary-b")
    c = run(d.state, "canary-c", READY, None, 40)
    assert c.canary == "canary-c"
    c = run(load(dump(c.state, ROLLOUT)), "canary-c", READY, None, 41)  # an operator restart in between
    back = run(c.state, "canary-b", READY, None, 50)
    assert (back.state.phase, back.canary, back.state.rolled_back, back.weight(ROLLOUT)) == \
        (ROLLED_BACK, None, "canary-b", 0)
    assert back.state.message.startswith("rolled back canary-b: ") and "canary canary-c dropped" in back.state.message
    assert [(e.type, e.reason) for e in back.events] == [("Normal", "RolloutAborted")]
    assert canary_condition(dump(back.state, ROLLOUT))["reason"] == "RolledBack"
    assert run(back.state, "canary-b", READY, None, 60).state == back.state  # as if the spec never left it
    assert run(back.state, "canary-b", Facts(0, False, retry_token="1"), None, 70).canary == "canary-b"
    # A retry asked for while C ran counts; the spec back to stable still forgets B and aborts C.
    retried = run(run(c.state, "canary-c", Facts(1, False, retry_token="1"), None, 45).state, "canary-b",
                  Facts(1, False, retry_token="1"), None, 50)
    assert (retried.state.phase, retried.canary, retried.state.rolled_back) == (PROGRESSING, "canary-b", None)
    aborted = run(c.state, "stable-a", READY, None, 50)
    assert canary_condition(dump(aborted.state, ROLLOUT))["reason"] == "Aborted"
    assert run(aborted.state, "canary-b", READY, None, 60).canary == "canary-b"


def test_a_spec_back_to_stable_after_a_rollback_is_no_abort():
    """B rolled back, then the spec back to the stable revision: CanaryReady turned from RolledBack
    to Aborted, and an Aborted Event repeated the rollback's message, though nothing ran."""
    from kiln.operator.status import canary_condition, transitions
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", READY, None, 1)
    d = run(run(d.state, "canary-b", READY, verdict(FAIL), 20).state, "canary-b", READY, verdict(FAIL), 30)
    rolled_back = [canary_condition(dump(d.state, ROLLOUT))]
    assert rolled_back[0]["reason"] == "RolledBack"
    reverted = run(d.state, "stable-a", READY, None, 40)
    assert (reverted.state.phase, reverted.state.rolled_back, reverted.events) == (ROLLED_BACK, None, [])
    after = [canary_condition(dump(reverted.state, ROLLOUT), rolled_back)]
    assert after[0]["reason"] == "RolledBack" and not transitions({"conditions": rolled_back},
                                                                  {"conditions": after})


def test_a_stable_revision_that_never_served_is_replaced_at_once():
    """A first revision whose engine crash-loops (a typo), then a fixed spec: the fix ran as a
    canary through every step and pause, while the router held the stable share for nobody."""
    from kiln.operator.canary import roll
    owner = Owner("chat", "ns", "uid")
    stable, fixed = revision_name("chat", spec_of("none")), revision_name("chat", spec_of("int8"))
    previous = {"rollout": dump(State(PROMOTED, stable, message=f"{stable} serves 100%"), ROLLOUT)}

    def with_pod(restarts: int, ready: bool = False) -> Observed:
        pod = ready_pod(stable, "stable-0")
        pod["status"] = {"conditions": [{"type": "Ready", "status": str(ready)}], "containerStatuses": [
            {"ready": ready, "restartCount": restarts, "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}}}]}
        return Observed.of(desired(owner, spec_of("none"), Observed(), "img").stable.deployment, pod)
    d = roll(owner, spec_of("int8"), with_pod(FAILED_STARTS), {}, previous, {}, 10)
    assert (d.state.phase, d.state.stable, d.canary) == (PROMOTED, fixed, None)
    assert f"stable revision {stable} serves nobody: its engine failed to start 3 times" in d.state.message
    # Still loading (or failed fewer times), or one replica ready: a baseline, so a canary as ever.
    for observed in (with_pod(0), with_pod(FAILED_STARTS - 1), with_pod(FAILED_STARTS, ready=True)):
        d = roll(owner, spec_of("int8"), observed, {}, previous, {}, 10)
        assert (d.state.phase, d.state.stable, d.canary) == (PROGRESSING, stable, fixed)


def test_a_steps_pause_runs_once_the_canary_has_the_replicas_the_step_sized_it_for():
    """10 stable replicas, a 50% step sizes the canary for 5: with 1 ready the router gave it a
    tenth of the step's share, and the pause (from the step's start) moved on, so the 50% weight
    was never what the checks judged."""
    d = run(None, "canary-b", READY, None, 0)
    d = run(d.state, "canary-b", Facts(1, False, step_size=2), None, 1)  # step 1: 20% of 10
    assert d.state.step == 1
    d = run(d.state, "canary-b", Facts(1, False, step_size=2), verdict(PASS), 40)  # the pause is over: not for it
    assert d.state.step == 1 and "1/2 of its replicas ready: the pause runs once they are" in d.state.message
    # Ready at 50: the pause runs from then, 30 s, with a passing check.
    sized = Facts(2, False, step_size=2, became_ready=50)
    assert run(d.state, "canary-b", sized, verdict(PASS), 70).state.step == 1
    d = run(d.state, "canary-b", sized, verdict(PASS), 81)
    assert d.state.step == 2
    # A person may still go on while it is short.
    short = run(d.state, "canary-b", Facts(2, False, step_size=5, resume_token="go"), None, 90)
    assert short.state.step == 3


def test_a_check_passed_before_the_step_had_its_replicas_does_not_carry_it_on():
    """A check passed while 1 of 2 replicas was ready (a tenth of the step's share) moved the
    step on once the pause from the second one's readiness was over, with no check at the
    step's weight."""
    d = run(None, "canary-b", READY, None, 0)
    d = run(d.state, "canary-b", Facts(1, False, step_size=2), None, 1)
    d = run(d.state, "canary-b", Facts(1, False, step_size=2), verdict(PASS), 20)
    sized = Facts(2, False, step_size=2, became_ready=50)
    d = run(d.state, "canary-b", sized, None, 81)
    assert d.state.step == 1 and "the pause is over but no analysis interval has passed" in d.state.message
    assert run(d.state, "canary-b", sized, verdict(PASS), 90).state.step == 2


def test_the_step_size_the_machine_waits_for_is_the_one_the_canary_is_given():
    from kiln.operator.canary import roll
    owner = Owner("chat", "ns", "uid")
    stable, canary = revision_name("chat", spec_of("none")), revision_name("chat", spec_of("int8"))
    deployment = desired(owner, spec_of("none"), Observed(), "img").stable.deployment
    deployment["spec"]["replicas"] = 4  # as scaled to spec.replicas
    observed = Observed.of(deployment, ready_pod(canary, "canary-0"))
    previous = {"rollout": dump(State(PROGRESSING, stable, canary, step=2, since=0, passed=1), ROLLOUT)}
    d = roll(owner, spec_of("int8"), observed, {}, previous, {}, 100)  # step 2 is 50%: 2 of 4
    assert d.state.step == 2 and "1/2 of its replicas ready" in d.state.message
    split = split_of(spec_of("int8"), d)
    canary_revision = next(r for r in desired(owner, spec_of("int8"), observed, "img", split=split).revisions
                           if r.name == canary)
    assert canary_revision.replicas == 2


def test_a_rollout_added_mid_replacement_waits_for_it_and_the_old_revision_serves_meanwhile():
    """The spec changed without a rollout (A replaced by B, B still loading), then again with one
    (C): C's canary started beside B at once, which retired A, the one revision serving, and
    weighted B at 100 with no replica ready, so requests were held until it loaded."""
    from kiln.operator.canary import roll
    owner = Owner("chat", "ns", "uid")
    a, b, c = (revision_name("chat", spec_of(q)) for q in ("none", "int8", "int4"))
    previous = {"revisions": [{"name": b, "role": "stable"}, {"name": a, "role": "old"}]}
    loading = Observed.of(deployment(a, ready=4, replicas=4), deployment(b, ready=1, replicas=4))
    for target in ("int4", "int8"):  # a new revision, or the one being replaced to (no canary either way)
        decision = roll(owner, spec_of(target), loading, {}, previous, {}, 10)
        assert (decision.state.phase, decision.canary, decision.state.stable) == (PROMOTED, None, b)
        want = desired(owner, spec_of(target), loading, "img", split=split_of(spec_of(target), decision))
        assert [(r.name, r.role, r.weight) for r in want.revisions] == [(b, "stable", None), (a, "old", None)]
        assert not [x for x in plan(want, loading) if x.verb == "delete"]
    waiting = roll(owner, spec_of("int4"), loading, {}, previous, {}, 10)
    assert f"canary {c} starts once {b} has replaced {a}" in waiting.state.message
    # B at full strength: the canary starts, A goes, and the split is weighted again.
    replaced = Observed.of(deployment(a, ready=4, replicas=4), deployment(b, ready=4, replicas=4))
    started = roll(owner, spec_of("int4"), replaced, {}, {"rollout": dump(waiting.state, ROLLOUT)}, {}, 20)
    assert (started.state.phase, started.canary, started.state.stable) == (PROGRESSING, c, b)
    want = desired(owner, spec_of("int4"), replaced, "img", split=split_of(spec_of("int4"), started))
    assert [(r.name, r.weight) for r in want.revisions] == [(b, 100), (c, 0)]
    assert ("delete", a) in [(x.verb, x.name) for x in plan(want, replaced) if x.kind == "Deployment"]
    # Nor does it wait for a replacement that is stuck (past its Deployment's progress deadline):
    # the new spec may be its fix.
    past = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "m"}]
    stuck = Observed.of(deployment(a, ready=4, replicas=4), deployment(b, ready=1, replicas=4, conditions=past))
    assert roll(owner, spec_of("int4"), stuck, {}, previous, {}, 10).canary == c


def test_a_step_short_of_its_replicas_is_rolled_back_after_the_deadline():
    """A 50% step sized the canary for 2 replicas, the 2nd could not be placed (no GPU free): the
    step waited for it, pause not running, forever; neither promoted nor rolled back."""
    d = run(None, "canary-b", READY, None, 0)
    d = run(d.state, "canary-b", Facts(1, False, step_size=2), None, 1)  # step 1 begins at 1
    short = Facts(1, False, step_size=2, became_ready=0)
    d = run(d.state, "canary-b", short, verdict(PASS), 121)  # inside progressDeadline (2m)
    assert (d.state.phase, d.state.step, d.state.passed) == (PROGRESSING, 1, 0)
    assert "1/2 of its replicas ready: the pause runs once they are" in d.state.message
    # From its last new ready replica, as for the scale-up before promotion: one at 60 is progress.
    assert run(d.state, "canary-b", Facts(1, False, step_size=2, became_ready=60), None, 170).state.phase == PROGRESSING
    back = run(d.state, "canary-b", short, None, 122)
    assert (back.state.phase, back.canary, back.state.rolled_back, back.weight(ROLLOUT)) == \
        (ROLLED_BACK, None, "canary-b", 0)
    assert back.state.message.startswith("rolled back canary-b: canary canary-b did not reach step 1/2's 2 replicas "
                                         "(1 ready): no replica became ready for 2m (progressDeadline)")
    # A replica that failed to start FAILED_STARTS times rolls it back at once.
    crashing = run(d.state, "canary-b", Facts(1, False, step_size=2, failing="pod b-2: the engine exited"), None, 30)
    assert crashing.state.phase == ROLLED_BACK
    assert f"its engine failed to start {FAILED_STARTS} times (pod b-2: the engine exited)" in crashing.state.message


def test_a_canary_falling_short_long_into_a_step_gets_the_whole_deadline_from_then():
    """The step's start (or the last replica's turn to ready) was the clock: a stable revision
    scaled up, or a canary pod evicted, past progressDeadline into a step rolled it back at once."""
    d = run(run(None, "canary-b", READY, None, 0).state, "canary-b", Facts(1, False, became_ready=0), None, 1)
    d = run(d.state, "canary-b", Facts(1, False, became_ready=0), None, 100)  # step 1, sized for 1: whole
    assert d.state.short_since is None
    short = Facts(1, False, step_size=2, became_ready=0)  # the stable revision doubled at 200
    d = run(d.state, "canary-b", short, None, 200)
    assert (d.state.phase, d.state.short_since) == (PROGRESSING, 200)
    d = run(load(dump(d.state, ROLLOUT)), "canary-b", short, None, 320)  # kept through an operator restart
    assert d.state.phase == PROGRESSING and d.state.short_since == 200
    assert run(d.state, "canary-b", short, None, 321).state.phase == ROLLED_BACK
    # Whole again before that: the next shortfall starts its own clock.
    whole = run(d.state, "canary-b", Facts(2, False, step_size=2, became_ready=300), None, 310)
    assert whole.state.short_since is None and "canaryShortSince" not in dump(whole.state, ROLLOUT)
    # The same before promotion: the canary at full size, then the stable revision scaled up.
    full = State(PROGRESSING, "stable-a", "canary-b", step=3, since=10)
    later = run(full, "canary-b", Facts(2, False, became_ready=5), None, 400)
    assert (later.state.phase, later.state.short_since) == (PROGRESSING, 400)
