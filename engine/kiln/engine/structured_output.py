"""Structured outputs: a JSON schema, a regex, a list of choices or a grammar that the output
must follow (vLLM's `structured_outputs`, OpenAI's `response_format`).

llguidance compiles a request's constraint into a matcher that knows, after any tokens, which
tokens may come next; the sampler sets every other token's logit to -inf before it chooses, and
the engine feeds the chosen token back to the matcher. The request ends ("stop") once the
constraint is complete and nothing can follow, so the text parses whenever max_tokens leaves room.
This is vLLM's `guidance` backend: the same library, computing a mask in about a millisecond a
token. Grammars are checked when a request arrives, and llguidance bounds what compiling one
may cost, so a bad or huge constraint is a 400 rather than a stalled engine. One that compiles
and outgrows those bounds only as tokens come ends its request in error (a 400 too), never as a
"stop" whose text would claim to follow it."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from kiln.engine.api_errors import strict_json
from kiln.engine.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from kiln.engine.sequence import Sequence
    from kiln.engine.tokenizer import Tokenizer


# llguidance follows a chain of rules (r0: r1, r1: r2, ...) or of $refs by recursion, about 3 KiB
# of stack a link: on a thread's usual 8 MiB one 40 KB request crashed the server (SIGSEGV).
# Matchers are compiled on a thread of COMPILE_STACK_BYTES (address space; pages are taken as
# touched), and a constraint over MAX_GRAMMAR_CHARS is refused: at most ~35k links, ~100 MiB.
MAX_GRAMMAR_CHARS = 512 * 1024
COMPILE_STACK_BYTES = 512 * 2**20
COMPILED_KEPT = 4  # compiled grammars kept to copy (Grammars.matcher)


def to_grammar(spec: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar (ValueError if a JSON schema is not JSON)."""
    if spec.regex is not None:
        # llguidance wraps the regex in /.../ and drops a final lone backslash ("a\" became /a/):
        # refused here, as the compiler refuses any other invalid regex.
        if (len(spec.regex) - len(spec.regex.rstrip("\\"))) % 2:
            raise ValueError(f"structured outputs: the regex does not compile: invalid regex "
                             f"{json.dumps(spec.regex)}: it ends in an incomplete escape (a lone backslash)")
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    if spec.choice is not None:
        # A Lark string literal takes JSON's escapes, so json.dumps quotes any text safely.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    schema = {"type": "object"} if spec.json_object else _schema(spec.json)
    # oneOf is taken as anyOf: llguidance cannot prove most oneOf branches disjoint, and refused
    # such schemas with a 400 ("Enable 'coerce_one_of'").
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"coerce_one_of": True},
        overrides={"whitespace_flexible": False} if spec.disable_any_whitespace else None)


def _schema(schema: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = strict_json(schema)  # 1e400 read as infinity became null in llguidance
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structured outputs: json is not a JSON schema: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured outputs: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


class Grammars:
    """Makes a matcher per request against the model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        # The last few grammars compiled, least recently used first: a request's n choices (and a
        # client repeating its schema) copy one (milliseconds) instead of each compiling it on the
        # engine thread (a second each for a large one: n=128 stalled every stream two minutes).
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # About half a second (it walks the vocabulary): made on the first constrained request,
        # so an engine that never sees one never pays it.
        return llguidance.LLTokenizer(self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                      eos_token=self._tokenizer.eos_token_ids)

    @cached_property
    def _compiler(self) -> ThreadPoolExecutor:
        """One thread with a deep stack (see COMPILE_STACK_BYTES), made at once while the size is set."""
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            compiler = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
            compiler.submit(lambda: None).result()
        finally:
            threading.stack_size(previous)
        return compiler

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output; ValueError naming what is wrong with it."""
        kind, grammar = spec.kinds[0].replace("_", " "), to_grammar(spec)
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured outputs: the {kind} is too large: {len(grammar)} characters as a "
                             f"grammar, at most {MAX_GRAMMAR_CHARS} are taken")
        compiled = self._compiled.pop(grammar, None)
        if compiled is None:
            compiled = self._compiler.submit(llguidance.LLMatcher, self.tokenizer, grammar, log_level=0).result()
            if compiled.is_error():
                raise ValueError(f"structured outputs: the {kind} does not compile: {compiled.get_error().strip()}")
        self._compiled[grammar] = compiled
        if len(self._compiled) > COMPILED_KEPT:
            self._compiled.popitem(last=False)
        return compiled.deep_copy()


def allowed_tokens(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """[len(masks), vocab_size] bool from matchers' bitmasks (compute_bitmask(): 32-bit little-endian
    words, bit i of word w for token 32w + i)."""
    words = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(len(masks), -1)
    bits = (words.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # byte-wise: bit i is token 8b + i
    return bits.view(len(masks), -1)[:, :vocab_size].bool()


def constrain(logits: torch.Tensor, seqs: list[Sequence], drafts: list[int] | None = None) -> torch.Tensor:
    """logits with what their matchers rule out set to -inf, for the rows that have one (a new
    tensor). drafts: per row, the speculative draft it checks, or -1 (the sampler's). A sequence's
    rows come in order, so each draft row's mask is its matcher's after the drafts before it: the
    matcher takes each row's draft once its mask is read, and gives them back at the end."""
    rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    masks = []
    consumed: dict[Sequence, int] = {}  # drafts each matcher took, to give back
    for i in rows:
        seq = seqs[i]
        masks.append(seq.matcher.compute_bitmask())
        # A matcher that has stopped (the grammar complete, then EOS) takes nothing more into
        # its history: rolling back a token it never took would undo one of the output's.
        if drafts is not None and drafts[i] >= 0 and not seq.matcher.is_stopped():
            seq.matcher.consume_token(drafts[i])
            consumed[seq] = consumed.get(seq, 0) + 1
    for seq, count in consumed.items():
        seq.matcher.rollback(count)
    allowed = allowed_tokens(masks, logits.shape[1]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))
