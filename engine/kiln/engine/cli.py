"""`kiln generate`: run one prompt through the engine and stream the answer to stdout."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.engine.sampling_params import StructuredOutputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="known name, model folder, or .gguf file")
    parser.add_argument("--prompt", required=True, help="the prompt text, or - to read it from standard input")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json-schema", default=None, metavar="SCHEMA",
                        help="the output follows this JSON schema: JSON text, or @FILE")
    parser.add_argument("--regex", default=None, help="the output matches this regular expression")
    parser.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    parser.add_argument("--grammar", default=None, metavar="LARK",
                        help="the output follows this Lark grammar (llguidance's dialect): text, or @FILE")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA and on CPUs with AVX512_BF16 "
                        "or AMX, else float32), float32, float16, bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None)
    add_memory_arguments(parser)
    add_quantization_arguments(parser)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """How the KV pool is sized and the GPU is run, shared by `kiln generate` and `kiln serve`."""
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="KV cache budget, e.g. 4Gi (default: on a GPU what --gpu-memory-utilization leaves, "
                             "on the CPU 1Gi)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's memory for weights, activations and KV cache (0 < x <= 1)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly (no CUDA graphs for decode steps)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights, no weight files read (benchmarks)")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|k|B)?\s*$")
_UNITS = {None: 1, "B": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_size(text: str) -> int:
    """'4Gi', '512Mi', '1.5G', '1073741824' -> bytes (Kubernetes quantity suffixes)."""
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (use e.g. 4Gi, 512Mi, 1G or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def add_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    """The weight and KV-cache formats, shared by `kiln generate` and `kiln serve` (choices spelled
    out: importing kiln.engine.config would import torch before the arguments are checked)."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="auto = the model dtype; int8 / fp8 hold about twice the tokens in the same memory")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "int4-rtn", "fp8"],
                        help="weight-only quantization at load (int8, int4, fp8 activation-aware scaled as AWQ does; int4-rtn plain)")
    parser.add_argument("--quantization-cache", default=None, metavar="DIR",
                        help="where quantized variants are cached, or 'off' (default $KILN_CACHE/variants)")
    parser.add_argument("--gguf-dequantize", action=argparse.BooleanOptionalAction, default=None,
                        help="dequantize a GGUF's Q8_0/Q4_0/Q4_1 weights on load, or (--no-...) serve them packed; "
                             "default: packed, but for float32 on the CPU, and Q8_0 on the CPU (no packed matmul there)")


def structured_outputs(args: argparse.Namespace) -> StructuredOutputs | None:
    """The constraint the flags ask for, if any (ValueError for two, or for a file that cannot be read)."""
    from kiln.engine.sampling_params import StructuredOutputs

    schema, grammar = _text_or_file(args.json_schema, "--json-schema"), _text_or_file(args.grammar, "--grammar")
    if schema is not None:
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"--json-schema is not JSON: {e}") from None
    if (schema, args.regex, args.choice, grammar) == (None,) * 4:
        return None
    return StructuredOutputs(json=schema, regex=args.regex, choice=args.choice, grammar=grammar)


def _text_or_file(value: str | None, flag: str) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {value[1:]}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from kiln.engine.sampling_params import SamplingParams

    try:
        # Check everything cheap before paying for the model load.
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
            repetition_penalty=args.repetition_penalty, structured_outputs=structured_outputs(args),
        )
        if args.system is not None and not args.chat:  # a plain prompt has no system turn
            raise ValueError("--system needs --chat")
        if args.prompt == "-":
            try:
                args.prompt = sys.stdin.buffer.read().decode()
            except UnicodeDecodeError as e:
                raise ValueError(f"the prompt on standard input is not UTF-8: {e}") from None
        if not args.prompt:
            raise ValueError("prompt is empty")
        from kiln.engine.config import Config  # torch from here on

        config = Config(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                        enforce_eager=args.enforce_eager, load_format=args.load_format, quantization=args.quantization,
                        quantization_cache=args.quantization_cache, gguf_dequantize=args.gguf_dequantize,
                        kv_cache_dtype=args.kv_cache_dtype)
        import jinja2

        from kiln.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        prompt: str | list[int] = args.prompt
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            try:
                text = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
            except jinja2.TemplateError as e:  # e.g. a template that refuses a system message
                raise ValueError(f"the model's chat template rejected the messages: {e}") from None
            # The template wrote the special tokens: a tokenizer that adds BOS would double it.
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        engine.add_request("cli", prompt, params)
    except (ValueError, OSError) as e:  # OSError: a model file that cannot be read
        print(f"kiln generate: error: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
