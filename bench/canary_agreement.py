"""The quality gate's greedy agreement through the router, beside `kiln eval`'s offline figure,
for each quantized variant of SmolLM2-135M. They measure the same thing (the variant scoring
the float model's own greedy tokens) by two roads: `kiln eval` in one process on whole batches,
the router per request over HTTP (stable `kiln serve` answers greedily with its token ids, the
canary `kiln serve` scores them with prompt_logprobs), so they should agree; this records by
how much they do not.

Real parts: a float32 `kiln serve` as the stable revision, one `kiln serve --quantization Q`
as the canary at a time, the real router app (in this process) with both as revisions and
mirroring every request, and the 12 prompts of `kiln eval` (data/eval_prompts.txt), 24
tokens each.

    .venv/bin/python bench/canary_agreement.py   # writes bench/results/canary-agreement-<date>-<cpu kind>.json
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
from pathlib import Path

import aiohttp

from cpu_common import REPO, machine, write_result
from online import ServerUnderTest, free_port
from kiln.engine.evaluate import CONTINUATION_TOKENS, eval_prompts
from kiln.router.endpoints import Endpoint, StaticEndpoints
from kiln.router.main import serving
from kiln.router.proxy import build_app
from kiln.router.traffic import Mirror, StaticTraffic, Traffic

MODEL = "smollm2-135m"
VARIANTS = ("int8", "fp8", "int4", "int4-rtn")


def kiln_serve(quantization: str, log_dir: Path, threads: int) -> ServerUnderTest:
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", MODEL, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--quantization", quantization]
    return ServerUnderTest(f"kiln-{quantization}", cmd, port, "/ready", log_dir / f"serve-{quantization}.log", threads)


def counters(text: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, s.labels.get("revision") or s.labels.get("outcome", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def through_router(stable: ServerUnderTest, canary: ServerUnderTest, variant: str) -> dict:
    """Every eval prompt through a router that mirrors all of them; the gate's figures."""
    def endpoint(server: ServerUnderTest, revision: str) -> Endpoint:
        return Endpoint("127.0.0.1", int(server.url.rsplit(":", 1)[1]), revision)
    source = StaticEndpoints([endpoint(stable, "stable"), endpoint(canary, variant)])
    traffic = StaticTraffic(Traffic({"stable": 100, variant: 0}, "stable", variant, Mirror(1.0, 1.0)))
    prompts = eval_prompts()
    async with serving(build_app(source, traffic=traffic), "127.0.0.1", 0) as port, \
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
        for prompt in prompts:  # one at a time: the mirror runs at most 4 comparisons at once
            async with client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0,
                                                            "max_tokens": CONTINUATION_TOKENS}) as response:
                assert response.status == 200, await response.text()
            while True:  # the comparison runs behind the client's answer
                seen = counters(await (await client.get("/metrics")).text())
                done = seen.get(("kiln_router_mirrored_requests_total", "scored"), 0) \
                    + seen.get(("kiln_router_mirrored_requests_total", "failed"), 0)
                if done >= prompts.index(prompt) + 1:
                    break
                await asyncio.sleep(0.05)
    tokens = seen.get(("kiln_router_mirror_tokens_total", variant), 0)
    floor_tokens = seen.get(("kiln_router_mirror_tokens_total", "stable"), 0)
    return {"agreement": seen.get(("kiln_router_mirror_agreed_total", variant), 0) / tokens if tokens else None,
            "tokens": int(tokens), "failed": int(seen.get(("kiln_router_mirrored_requests_total", "failed"), 0)),
            "noise_floor": seen.get(("kiln_router_mirror_agreed_total", "stable"), 0) / floor_tokens
            if floor_tokens else None}


def offline(variant: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "eval", "--model", MODEL, "--quantization", variant,
                           "--json"], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kiln-bench-canary"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "model": MODEL, "dtype": "float32", "prompts": len(eval_prompts()),
              "max_tokens": CONTINUATION_TOKENS, "variants": {}}
    stable = kiln_serve("none", args.log_dir, args.threads)
    try:
        for variant in args.variants:
            canary = kiln_serve(variant, args.log_dir, args.threads)
            try:
                routed = asyncio.run(through_router(stable, canary, variant))
            finally:
                canary.stop()
            row = {"router": routed, "kiln_eval": offline(variant)}
            row["difference"] = None if routed["agreement"] is None else \
                round(routed["agreement"] - row["kiln_eval"]["agreement"], 4)
            record["variants"][variant] = row
            print(f"{variant:<9} router {routed['agreement']:.3f} ({routed['tokens']} tokens, floor "
                  f"{routed['noise_floor']})  kiln eval {row['kiln_eval']['agreement']:.3f}  "
                  f"difference {row['difference']:+.3f}", flush=True)
    finally:
        stable.stop()
    print(f"wrote {write_result('canary-agreement', record)}")


if __name__ == "__main__":
    main()
