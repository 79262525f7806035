"""What LoRA adapters cost: Kiln serving the first 32 requests of the mixed workload (../shared/bench,
EOS ignored) at once on the base model, on one adapter, and on four adapters mixed in the batch
(max_loras 4), and batch-1 decode on the base model and on an adapter; the peer is transformers
`generate` on the same weights with one adapter merged in (what serving an adapter costs without
multi-adapter serving: a deployment per adapter), batch 8 as in bench/offline.py. The adapters are
random PEFT folders of rank 16 on every projection (speed does not depend on the values).

    .venv/bin/python bench/lora.py   # writes bench/results/lora-<date>-<cpu kind>.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from cpu_common import write_result
from offline import WORKLOAD, load_transformers, machine_info, run_transformers
from online import served_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lora_support import SMOLLM2, merged_into, write_adapter  # noqa: E402

ADAPTERS = 4
RANK = 16


def tokens_per_second(llm, requests: list[dict], loras: list[str | None]) -> float:
    """All requests at once, request i with loras[i % len(loras)]."""
    from kiln.engine import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r["prompt_ids"], SamplingParams(temperature=0.0, max_tokens=r["out_len"],
                                                                    ignore_eos=True), loras[i % len(loras)])
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.token_ids) for o in engine.step() if o.finished)
    return round(generated / (time.perf_counter() - start), 1)


def batch1_decode(llm, lora: str | None, tokens: int = 64) -> float:
    from kiln.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate("The history of the printing press", params, lora=lora)[0]
    return round(len(out.token_ids) / (time.perf_counter() - start), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    from kiln.engine import LLM

    dtype = served_dtype(args.dtype)
    requests = json.loads(WORKLOAD.read_text())["requests"][:args.requests]
    folder = Path(tempfile.mkdtemp(prefix="kiln-lora-bench-"))
    tensors = [write_adapter(folder / f"a{i}", SMOLLM2, seed=i, rank=RANK, alpha=2 * RANK) for i in range(ADAPTERS)]
    names = [f"a{i}" for i in range(ADAPTERS)]
    plain = LLM(dtype=dtype, gguf_dequantize=True)
    llm = LLM(dtype=dtype, gguf_dequantize=True, enable_lora=True, max_loras=ADAPTERS,
              lora_modules=tuple((name, str(folder / name)) for name in names))
    for engine in (plain, llm):  # warm-up
        batch1_decode(engine, None, 4)
    batch1_decode(llm, names[0], 4)
    result = {"dtype": dtype, "rank": RANK, "adapters": ADAPTERS, "requests": len(requests),
              "machine": machine_info()}
    print(json.dumps(result["machine"]), flush=True)
    result["kiln_no_lora_tok_s"] = tokens_per_second(plain, requests, [None])
    result["kiln_lora_enabled_base_tok_s"] = tokens_per_second(llm, requests, [None])
    result["kiln_one_adapter_tok_s"] = tokens_per_second(llm, requests, [names[0]])
    result["kiln_four_adapters_mixed_tok_s"] = tokens_per_second(llm, requests, names)
    result["kiln_batch1_base_tok_s"] = batch1_decode(plain, None)
    result["kiln_batch1_adapter_tok_s"] = batch1_decode(llm, names[0])
    model = load_transformers(dtype)
    merged_into(model, tensors[0], 2.0)
    peer = run_transformers(requests, 8, model)
    # Useful tokens, as Kiln's are counted: a padded batch generates to its longest request.
    result["transformers_merged_tok_s"] = round(sum(r["out_len"] for r in requests) / peer["seconds"], 1)
    base = result["kiln_no_lora_tok_s"]
    result["one_adapter_over_base"] = round(result["kiln_one_adapter_tok_s"] / base, 2)
    result["four_mixed_over_base"] = round(result["kiln_four_adapters_mixed_tok_s"] / base, 2)
    result["batch1_adapter_over_base"] = round(result["kiln_batch1_adapter_tok_s"] / result["kiln_batch1_base_tok_s"], 2)
    result["four_mixed_over_transformers_merged"] = round(
        result["kiln_four_adapters_mixed_tok_s"] / result["transformers_merged_tok_s"], 2)
    print(f"{len(requests)} at once: base {base} tok/s (LoRA enabled, no adapter: "
          f"{result['kiln_lora_enabled_base_tok_s']}), one adapter {result['kiln_one_adapter_tok_s']} "
          f"({result['one_adapter_over_base']}x), {ADAPTERS} adapters mixed {result['kiln_four_adapters_mixed_tok_s']} "
          f"({result['four_mixed_over_base']}x); transformers with one adapter merged (batch 8) "
          f"{result['transformers_merged_tok_s']} tok/s: Kiln's {ADAPTERS} mixed / it = "
          f"{result['four_mixed_over_transformers_merged']}x; batch 1: base {result['kiln_batch1_base_tok_s']}, "
          f"adapter {result['kiln_batch1_adapter_tok_s']} tok/s ({result['batch1_adapter_over_base']}x)", flush=True)
    print(f"wrote {write_result('lora', result)}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
