"""`kiln eval`: how far a quantized variant is from the unquantized model it came from.

Both run on the same device in the same dtype (float32 on the CPU by default, so the figures are
stable), and three figures compare them:
  perplexity  on data/heldout.txt -- Charles Dickens, A Tale of Two Cities (1859), the opening
              chapter, public domain; not the calibration text (awq.calibration_text) -- scored
              in windows of WINDOW tokens (fewer where the model's context is shorter), at most
              MAX_HELDOUT_TOKENS in all
  mean KL     KL(reference || variant) of the next-token distributions at the same positions
  agreement   teacher-forced greedy agreement (greedy_agreement) over the reference's own greedy
              continuations of the prompts in data/eval_prompts.txt

With a quantized KV cache (kv_cache_dtype int8/fp8) the variant is scored through the paged
attention path: a KV pool is attached (ModelRunner) and each sequence goes in chunks, its first
token alone, so every scored position attends over K/V read back from the quantized cache.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.config import Config, ModelConfig, resolve_max_model_len
from kiln.engine.context import Context, prefill_context, reset_context, set_context
from kiln.engine.model_runner import ModelRunner, kv_block_bytes
from kiln.engine.quantization import resident_weight_bytes
from kiln.engine.tokenizer import Tokenizer

WINDOW = 256
MAX_HELDOUT_TOKENS = 1024
CONTINUATION_TOKENS = 24
KV_CHUNK = 32


def heldout_text() -> str:
    return resources.files("kiln.engine").joinpath("data/heldout.txt").read_text(encoding="utf-8")


def eval_prompts() -> list[str]:
    text = resources.files("kiln.engine").joinpath("data/eval_prompts.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def greedy_agreement(reference: list[list[int]], predicted: list[list[int]]) -> float:
    """Teacher-forced greedy agreement: the share of positions j where predicted[i][j] -- the
    variant's argmax given prompt i and reference[i][:j] -- equals reference[i][j], the
    reference model's own greedy token there."""
    if len(reference) != len(predicted) or any(len(r) != len(p) for r, p in zip(reference, predicted)):
        raise ValueError("reference and predicted continuations differ in shape")
    total = sum(len(r) for r in reference)
    if total == 0:
        raise ValueError("no continuation tokens to compare")
    return sum(a == b for r, p in zip(reference, predicted) for a, b in zip(r, p)) / total


class Scorer:
    """Logits of a model over whole token sequences, and greedy generation. pool: a KV pool
    attached to the model (attach_pool), needed to generate; through_cache: score through it
    (chunk by chunk over the paged cache) instead of in one plain prefill."""

    def __init__(self, model: nn.Module, pool: ModelRunner | None = None, block_size: int = 16,
                 through_cache: bool = False) -> None:
        if through_cache and pool is None:
            raise ValueError("scoring through the KV cache needs a KV pool")
        self.model, self.pool, self.block_size, self.through_cache = model, pool, block_size, through_cache

    def _hidden(self, new: list[list[int]], starts: list[int], tables: list[list[int]] | None) -> torch.Tensor:
        """One forward of the new tokens of each sequence, which start at starts; tables: each
        sequence's blocks in the pool (None: a plain prefill that touches no cache)."""
        device = next(self.model.parameters()).device
        if tables is None:
            context = prefill_context([len(n) for n in new], device)
        else:
            bs = self.block_size
            slots = [t[p // bs] * bs + p % bs for n, s, t in zip(new, starts, tables) for p in range(s, s + len(n))]
            lens = [s + len(n) for n, s in zip(new, starts)]
            width = max(len(t) for t in tables)
            context = Context(
                cu_seqlens_q=torch.tensor([0] + [sum(len(n) for n in new[:i + 1]) for i in range(len(new))],
                                          dtype=torch.int32, device=device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                max_seqlen_q=max(len(n) for n in new), max_seqlen_k=max(lens),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                          device=device))
        ids = torch.tensor([t for n in new for t in n], dtype=torch.int64, device=device)
        positions = torch.tensor([p for n, s in zip(new, starts) for p in range(s, s + len(n))], device=device)
        set_context(context)
        try:
            with torch.inference_mode():
                return self.model(ids, positions)
        finally:
            reset_context()

    def _tables(self, lengths: list[int]) -> list[list[int]]:
        """Block i * B .. (i + 1) * B - 1 for sequence i: a fixed, disjoint range each."""
        per_seq = max(math.ceil(n / self.block_size) for n in lengths)
        if per_seq * len(lengths) > self.pool.num_blocks:
            raise ValueError(f"the evaluation KV pool holds {self.pool.num_blocks} blocks, "
                             f"{per_seq * len(lengths)} are needed")
        return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(lengths))]

    def logits(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits [len(s), vocab] of each sequence s, row j predicting token j + 1."""
        if not self.through_cache:
            hidden = self._hidden(seqs, [0] * len(seqs), None)
            return list(self.model.compute_logits(hidden).split([len(s) for s in seqs]))
        out = []
        for seq in seqs:
            table = self._tables([len(seq)])
            # The first token alone: every later chunk attends over K/V read back from the cache.
            bounds = [0, *range(1, len(seq), KV_CHUNK), len(seq)]
            parts = [self.model.compute_logits(self._hidden([seq[lo:hi]], [lo], table))
                     for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
            out.append(torch.cat(parts))
        return out

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Each prompt's greedy continuation of max_tokens (EOS ignored), decoded through the pool."""
        if self.pool is None:
            raise ValueError("greedy generation needs a KV pool")
        tables = self._tables([len(p) + max_tokens for p in prompts])
        new, starts = [list(p) for p in prompts], [0] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_tokens):
            hidden = self._hidden(new, starts, tables)
            last = [sum(len(n) for n in new[:i + 1]) - 1 for i in range(len(new))]
            tokens = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
            starts = [s + len(n) for s, n in zip(starts, new)]
            new = [[t] for t in tokens]
            for o, t in zip(out, tokens):
                o.append(t)
        return out


def attach_pool(model: nn.Module, model_config: ModelConfig, config: Config, num_seqs: int,
                max_len: int) -> ModelRunner:
    """A ModelRunner's KV pool on model, just big enough for num_seqs sequences of max_len tokens
    in config's kv_cache_dtype. It stays attached: use it on a model this evaluation owns."""
    blocks = num_seqs * math.ceil(max_len / config.block_size)
    memory = blocks * kv_block_bytes(model_config, config.block_size, config.kv_cache_torch_dtype)
    return ModelRunner(replace(config, kv_cache_memory=memory), model, model_config)


@dataclass
class EvalResult:
    method: str
    kv_cache_dtype: str
    perplexity_ref: float
    perplexity_variant: float
    mean_kl: float
    agreement: float
    linear_bytes_ref: int
    linear_bytes_variant: int
    tokens_scored: int  # held-out positions in perplexity and KL
    agreement_tokens: int

    @property
    def ppl_ratio(self) -> float:
        return self.perplexity_variant / self.perplexity_ref

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_ratio": self.ppl_ratio}

    def table(self) -> str:
        rows = [("", "reference", "variant"),
                ("perplexity", f"{self.perplexity_ref:.4f}", f"{self.perplexity_variant:.4f}"),
                ("resident linear bytes", f"{self.linear_bytes_ref:,}", f"{self.linear_bytes_variant:,}")]
        lines = [f"{a:<24}{b:>16}{c:>16}" for a, b, c in rows]
        lines += [f"perplexity ratio        {self.ppl_ratio:.4f}",
                  f"mean KL(ref || variant) {self.mean_kl:.5f} nats over {self.tokens_scored} held-out tokens",
                  f"greedy agreement        {self.agreement:.4f} over {self.agreement_tokens} tokens (teacher-forced)"]
        return f"weights {self.method}, KV cache {self.kv_cache_dtype}\n" + "\n".join(lines)


def reference_continuations(reference: Scorer, tokenizer: Tokenizer, max_tokens: int = CONTINUATION_TOKENS
                            ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, the reference's greedy continuation of each) for data/eval_prompts.txt."""
    prompts = [tokenizer.encode(p) for p in eval_prompts()]
    return prompts, reference.greedy(prompts, max_tokens)


def evaluate(reference: Scorer, variant: Scorer, tokenizer: Tokenizer, method: str, kv_cache_dtype: str = "auto",
             continuations: tuple[list[list[int]], list[list[int]]] | None = None,
             window: int = WINDOW) -> EvalResult:
    """Compare variant against reference (see the module docstring). continuations: what
    reference_continuations returned, to reuse across variants; window: the held-out window's
    length in tokens, at most the models' context."""
    ids = tokenizer.encode(heldout_text())[:MAX_HELDOUT_TOKENS]
    windows = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    nll_ref = nll_var = kl = 0.0
    scored = 0
    for window in windows:  # one at a time: a window's logits are WINDOW x vocab floats per model
        target = torch.tensor(window[1:])
        ref = torch.log_softmax(reference.logits([window])[0][:-1], -1)
        var = torch.log_softmax(variant.logits([window])[0][:-1], -1)
        nll_ref += F.nll_loss(ref, target, reduction="sum").item()
        nll_var += F.nll_loss(var, target, reduction="sum").item()
        kl += F.kl_div(var, ref, log_target=True, reduction="sum").item()
        scored += len(target)
    prompts, conts = continuations or reference_continuations(reference, tokenizer)
    logits = variant.logits([p + c for p, c in zip(prompts, conts)])
    predicted = [lg[len(p) - 1:len(p) - 1 + len(c)].argmax(-1).tolist() for lg, p, c in zip(logits, prompts, conts)]
    return EvalResult(
        method=method, kv_cache_dtype=kv_cache_dtype,
        perplexity_ref=math.exp(nll_ref / scored), perplexity_variant=math.exp(nll_var / scored),
        mean_kl=kl / scored, agreement=greedy_agreement(conts, predicted),
        linear_bytes_ref=resident_weight_bytes(reference.model, linears_only=True),
        linear_bytes_variant=resident_weight_bytes(variant.model, linears_only=True),
        tokens_scored=scored, agreement_tokens=sum(len(c) for c in conts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="known name, model folder, or .gguf file (unquantized)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "int4-rtn", "fp8"],
                        help="the variant's weight quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="the variant's KV cache dtype")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of both models")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization-cache", default=None, metavar="DIR",
                        help="variant cache directory, or 'off' (default $KILN_CACHE/variants)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from kiln.engine.loader import load_model, resolve_model_path
    from kiln.engine.quantized_folder import read_marker
    try:
        if args.quantization == "none" and args.kv_cache_dtype == "auto":
            raise ValueError("nothing to compare: the variant is the model itself; give --quantization or "
                             "--kv-cache-dtype")
        path = resolve_model_path(args.model)
        if path.is_dir() and read_marker(path) is not None:
            raise ValueError(f"{path} is a quantized variant; give the unquantized model and --quantization")
        # gguf_dequantize: the reference is the float model the variant is quantized from, not a
        # GGUF's packed Q4/Q8 projections.
        ref_config = Config(model=args.model, dtype=args.dtype, device=args.device, gguf_dequantize=True)
        var_config = replace(ref_config, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                             quantization_cache=args.quantization_cache)
        ref, var = load_model(ref_config), load_model(var_config)
        prompts = [ref.tokenizer.encode(p) for p in eval_prompts()]
        longest = max(len(p) for p in prompts) + CONTINUATION_TOKENS
        # Positions past the model's context are outside its RoPE table: the forward raised there.
        max_len = resolve_max_model_len(ref_config, ref.model_config)
        if longest > max_len:
            raise ValueError(f"the model's context of {max_len} tokens is shorter than the evaluation's longest "
                             f"prompt and continuation ({longest} tokens)")
        window = min(WINDOW, max_len)
        reference = Scorer(ref.model, attach_pool(ref.model, ref.model_config, ref_config, len(prompts), longest),
                           ref_config.block_size)
        kv_quantized = args.kv_cache_dtype != "auto"
        pool = attach_pool(var.model, var.model_config, var_config, 1, max(window, longest)) if kv_quantized else None
        variant = Scorer(var.model, pool, var_config.block_size, through_cache=kv_quantized)
    except (ValueError, OSError) as e:  # OSError: a model file that cannot be read
        print(f"kiln eval: error: {e}", file=sys.stderr)
        return 2
    result = evaluate(reference, variant, ref.tokenizer, args.quantization, args.kv_cache_dtype,
                      (prompts, reference.greedy(prompts, CONTINUATION_TOKENS)), window)
    print(json.dumps(result.to_dict()) if args.json else result.table())
    return 0
