"""Prefix affinity in the router, measured: two `kiln serve` replicas (prefix caching on) behind an
in-process router, with affinity (--prefix-slack 8, the default) and balancing on load alone
(--prefix-slack -1, the least-in-flight routing every earlier release did) in the same run,
alternating, each round with documents of its own so no cache carries over.

Workload: conversations, each on a document of its own (~500 SmolLM2 tokens), several turns each:
turn k's prompt is the document, then every earlier question and answer, then question k (as a
chat client resends the history). A few conversations run at once, each turn after the last one's
answer and a random pause (up to --think-s), so turns do not arrive in step. Reports per mode: the replicas' prefix-cache hit rate (prompt tokens found cached, from
their /metrics), TTFT mean and p50/p95 of the turns after the first, and affinity's ratio to load
alone. Machine flags recorded (BENCHMARKS.md).

    python bench/prefix_routing.py            # results to bench/results/prefix-routing-<date>-<cpu kind>.json
    python bench/prefix_routing.py --conversations 4 --turns 3 --rounds 1
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from cpu_common import machine, write_result
from online import TOPICS, ServerUnderTest, free_port, one_request
from kiln.engine.dtype_choice import auto_dtype, host_cpu_flags
from kiln.router.endpoints import Endpoint, StaticEndpoints
from kiln.router.main import serving
from kiln.router.proxy import Limits, build_app

MODES = {"affinity": Limits().prefix_slack, "load_only": -1}


def document(tag: str, i: int) -> str:
    rng = random.Random(f"{tag}-{i}")
    facts = [f"Fact {n}: the {rng.choice(TOPICS)} of {tag} case {i} is {rng.randint(10, 999)} units."
             for n in range(24)]
    return f"Case file {tag}-{i}.\n" + " ".join(facts) + "\n"


async def conversation(session: aiohttp.ClientSession, url: str, doc: str, args: argparse.Namespace) -> list:
    history, samples, rng = doc, [], random.Random(doc)
    for k in range(args.turns):
        await asyncio.sleep(rng.uniform(0, args.think_s))  # the user reads and types: turns do not arrive in step
        history += f"\nQuestion {k + 1}: what is fact {3 * k + 1} about?\nAnswer:"
        body = {"model": "smol", "prompt": history, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        sample = await one_request(session, url, body)
        if sample.error:
            raise RuntimeError(sample.error)
        samples.append(sample)
        history += " (answered)"  # the reply's text would differ per replica only in timing, not here
    return samples


def cache_counters(engines: list[ServerUnderTest]) -> tuple[float, float]:
    """(prompt tokens looked up, found) in the prefix caches, summed over the replicas."""
    queries = hits = 0.0
    for engine in engines:
        with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                for s in family.samples:
                    queries += s.value if s.name == "kiln:prefix_cache_queries_total" else 0
                    hits += s.value if s.name == "kiln:prefix_cache_hits_total" else 0
    return queries, hits


async def run_mode(engines: list[ServerUnderTest], slack: int, tag: str, args: argparse.Namespace) -> dict:
    endpoints = StaticEndpoints([Endpoint("127.0.0.1", int(e.url.rsplit(":", 1)[1])) for e in engines])
    before = cache_counters(engines)
    async with serving(build_app(endpoints, Limits(prefix_slack=slack)), "127.0.0.1", 0) as port:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            pending = [document(tag, i) for i in range(args.conversations)]
            samples: list = []
            while pending:  # args.concurrent conversations at a time
                batch, pending = pending[:args.concurrent], pending[args.concurrent:]
                for turns in await asyncio.gather(*(conversation(session, url, d, args) for d in batch)):
                    samples.append(turns)
    after = cache_counters(engines)
    later = [s.ttft for turns in samples for s in turns[1:]]
    return {"prefix_slack": slack, "requests": sum(len(t) for t in samples),
            "prompt_tokens": sum(s.prompt_tokens for t in samples for s in t),
            "cache_hit_rate": (after[1] - before[1]) / max(after[0] - before[0], 1),
            "ttft_later_turns_s": {"mean": float(np.mean(later)), "p50": float(np.percentile(later, 50)),
                                   "p95": float(np.percentile(later, 95))},
            "ttft_first_turns_mean_s": float(np.mean([t[0].ttft for t in samples]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=4, help="conversations at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--think-s", type=float, default=0.5, help="most seconds between a reply and the next turn")
    parser.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/kiln-bench-prefix-routing"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    dtype = str(auto_dtype("cpu", host_cpu_flags())).removeprefix("torch.")
    engines = []
    try:
        for r in range(2):
            port = free_port()
            engines.append(ServerUnderTest(
                f"replica-{r}", [sys.executable, "-m", "kiln.cli", "serve", "--served-model-name", "smol",
                                 "--dtype", dtype, "--max-model-len", "4096", "--host", "127.0.0.1", "--port",
                                 str(port), "--log-level", "WARNING"],
                port, "/ready", args.log_dir / f"replica-{r}.log", args.threads))
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode, slack in MODES.items():
                result = asyncio.run(run_mode(engines, slack, f"{mode}{round_}", args))
                runs[mode].append(result)
                print(f"round {round_} {mode:9s}: cache hit rate {result['cache_hit_rate']:.2f}, TTFT of later "
                      f"turns mean {result['ttft_later_turns_s']['mean'] * 1e3:.0f} ms "
                      f"(p95 {result['ttft_later_turns_s']['p95'] * 1e3:.0f} ms)", flush=True)
    finally:
        for engine in engines:
            engine.stop()
    mean = {mode: float(np.mean([r["ttft_later_turns_s"]["mean"] for r in rs])) for mode, rs in runs.items()}
    hit = {mode: float(np.mean([r["cache_hit_rate"] for r in rs])) for mode, rs in runs.items()}
    summary = {"cache_hit_rate": hit, "ttft_later_turns_mean_s": mean,
               "ttft_load_only_over_affinity": mean["load_only"] / mean["affinity"]}
    print(f"affinity: cache hit rate {hit['affinity']:.2f} vs {hit['load_only']:.2f} on load alone; TTFT of later "
          f"turns {mean['affinity'] * 1e3:.0f} vs {mean['load_only'] * 1e3:.0f} ms: "
          f"{summary['ttft_load_only_over_affinity']:.2f}x faster")
    out = write_result("prefix-routing", {"machine": machine(), "dtype": dtype, "settings": vars(args) | {
        "log_dir": str(args.log_dir)}, "runs": runs, "summary": summary})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
