"""The builtin autoscaler's scraper against real HTTP servers standing in for engine and router
pods: well-formed pages, a page that hangs past the timeout, garbage, and a refused port. Also the
canary analysis on a page the router's own metrics wrote."""
from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.operator.analysis import FAIL, PASS, Check, check, figures
from kiln.operator.models import Analysis
from kiln.operator.scrape import TIMEOUT_S, read_samples, scrape
from kiln.router.balancer import LeastInFlight
from kiln.router.endpoints import StaticEndpoints
from kiln.router.metrics import RouterMetrics

ENGINE = "kiln:num_requests_waiting{{model_name=\"m\"}} {waiting}\nkiln:num_requests_running{{model_name=\"m\"}} {running}\n"
ROUTER = "kiln_router_held_requests {held}\nkiln_router_last_cold_start_seconds {cold}\n"


@contextmanager
def serving(body: str, delay: float = 0.0) -> Iterator[str]:
    """A /metrics page on 127.0.0.1; `delay` seconds before it answers."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(delay)
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/metrics"


def test_load_is_engines_queues_plus_held_requests():
    with serving(ENGINE.format(waiting=3, running=5)) as a, serving(ENGINE.format(waiting=0, running=2)) as b, \
            serving(ROUTER.format(held=4, cold=0)) as router:
        taken = scrape([a, b], [router], now=10.0)
    assert (taken.sample.time, taken.sample.load) == (10.0, 14.0)
    assert taken.cold_start is None  # 0 means the router never saw a cold start


def test_the_cold_start_reported_is_the_newest_routers_not_the_largest():
    """Each router keeps its last cold start: one router's slow start long ago must not stand for
    the later, faster ones the others saw."""
    old = ROUTER.format(held=0, cold=600) + "kiln_router_last_cold_start_timestamp_seconds 1000\n"
    new = ROUTER.format(held=0, cold=20) + "kiln_router_last_cold_start_timestamp_seconds 5000\n"
    with serving(ENGINE.format(waiting=0, running=1)) as engine, serving(old) as a, serving(new) as b:
        assert scrape([engine], [a, b], now=1.0).cold_start == 20


def test_requests_queued_at_the_router_count_as_load():
    page = ROUTER.format(held=1, cold=0) + "kiln_router_queued_requests 6\n"
    with serving(ENGINE.format(waiting=0, running=4)) as engine, serving(page) as router:
        assert scrape([engine], [router], now=1.0).sample.load == 11.0  # 4 running + 1 held + 6 in line


def test_engines_that_do_not_answer_count_at_the_average_never_at_zero():
    with serving(ENGINE.format(waiting=2, running=4)) as ok, serving(ENGINE.format(waiting=9, running=9),
                                                                     delay=TIMEOUT_S + 1) as hung, \
            serving("this is not { prometheus") as garbage, serving(ROUTER.format(held=0, cold=12.5)) as router:
        started = time.monotonic()
        taken = scrape([ok, hung, garbage, refused_url()], [router], now=1.0)
        assert time.monotonic() - started < TIMEOUT_S + 3  # each bounded: the hung one did not hold it
    assert taken.sample.load == 6.0 * 4 and taken.cold_start == 12.5


def test_no_sample_without_a_router_or_without_any_engine_answer():
    with serving(ENGINE.format(waiting=1, running=1)) as engine, serving(ROUTER.format(held=2, cold=0)) as router:
        assert scrape([engine], [refused_url()], now=1.0).sample is None  # held requests unknown
        assert scrape([refused_url()], [router], now=1.0).sample is None  # engines run, none answered
        assert scrape([], [router], now=1.0).sample.load == 2.0  # at zero: the held requests are the load


def test_nan_infinite_or_negative_counts_are_garbage_never_load():
    with serving(ENGINE.format(waiting=2, running=4)) as ok, serving(ENGINE.format(waiting="NaN", running=1)) as nan, \
            serving(ENGINE.format(waiting=-40, running=0)) as negative, \
            serving(ENGINE.format(waiting="+Inf", running=0)) as inf, serving(ROUTER.format(held=0, cold=0)) as router, \
            serving(ROUTER.format(held="NaN", cold=0)) as bad_router:
        taken = scrape([ok, nan, negative, inf], [router, bad_router], now=1.0)
        assert taken.sample.load == 6.0 * 4  # the three count at the average of the one that answered sanely
        assert scrape([nan], [router], now=1.0).sample is None  # no engine answered sanely: no sample
        assert scrape([], [bad_router], now=1.0).sample is None
    # A NaN cold start went into the status as a bare NaN, which the API server refuses as JSON.
    with serving(ROUTER.format(held=0, cold="NaN")) as nan_cold, serving(ROUTER.format(held=0, cold=3)) as router:
        assert scrape([], [nan_cold], now=1.0).cold_start is None
        assert scrape([], [nan_cold, router], now=1.0).cold_start == 3


def judged(stable: tuple[float, float], canary: tuple[float, float]) -> Check:
    """The analysis (default thresholds: 1.25) of a router page where each revision streamed 20
    answers, each with this (time to first token, inter-token gap) in seconds."""
    source = StaticEndpoints([])
    metrics = RouterMetrics(source, LeastInFlight(source), held=lambda: 0)
    for revision, (ttft, itl) in (("stable", stable), ("canary", canary)):
        for _ in range(20):
            metrics.answered(revision, 200, ttft + 1.0)
            metrics.time_to_first_token.labels(revision).observe(ttft)
            metrics.inter_token_latency.labels(revision).observe(itl)
    with serving(metrics.render().decode()) as url:
        found = figures(read_samples(url))
    return check(found["canary"], found["stable"], Analysis())


def test_the_routers_latency_buckets_are_fine_enough_for_the_p95_ratios():
    """TTFT 1.05 s against 2.4 s, and ITL 11 ms against 19.5 ms, each fell in one bucket (1 -> 2.5 s,
    0.01 -> 0.02 s), read as a p95 ratio of 1.0: a canary 1.8 to 2.3 times as slow passed 1.25."""
    slow = judged(stable=(1.05, 0.011), canary=(2.4, 0.0195))
    assert slow.verdict == FAIL and [f.split(" p95")[0] for f in slow.failed] == ["TTFT", "ITL"]
    assert slow.figures["ttftP95Ratio"] > 1.8 and slow.figures["itlP95Ratio"] > 1.5
    # Close latencies still pass, in one bucket or across a bound.
    assert judged(stable=(1.05, 0.011), canary=(1.1, 0.0115)).verdict == PASS
    assert judged(stable=(1.05, 0.011), canary=(1.15, 0.0125)).verdict == PASS
