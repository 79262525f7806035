"""Turn one row of logits per sequence into its next token, the whole batch at once.

Order of work: logit_bias, then penalties (vLLM's order), then min_tokens (no stop token yet), then structured
outputs (what the request's grammar allows) change the logits; greedy rows take the argmax; the
others are scaled by temperature, cut by top-k / top-p / min-p, and drawn. Drawing uses the exponential race
(argmax of p / E with E ~ Exp(1) is a draw from p), which lets a request with a seed draw its
noise from its own torch.Generator while the rest of the batch shares the engine's. A seeded
request's noise for output position t is seeded by (seed, t) alone, so its text does not depend
on what else runs, on preemption, or on how many speculative drafts it checked.
Logprobs are those of the model's raw distribution, before any of this.
A step whose logits are not all finite is sampled from them made finite (finite_logits), so a broken
row still yields a valid token and finite logprobs, never NaN probabilities; the check's host copy
travels with the tokens' (one sync per step on a GPU).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from kiln.engine.kernels.backend import torch_argmax
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence
from kiln.engine.structured_output import constrain

log = logging.getLogger(__name__)

# Real logits stay within a few hundred; these bounds only ever bite on overflowed or NaN rows.
LOGIT_LIMIT = 1e4
MASK64 = (1 << 64) - 1


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -LOGIT_LIMIT (never preferred), +-inf -> +-LOGIT_LIMIT: every row keeps a finite
    maximum, so its softmax is never NaN (softmax of a NaN, or of a row all -inf, is)."""
    return logits.nan_to_num(nan=-LOGIT_LIMIT).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """counts[i, t] = how often token t occurs in token_lists[i]."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    # Pad with an extra column id that is dropped afterwards.
    ids = torch.tensor([tokens + [vocab_size] * (width - len(tokens)) for tokens in token_lists], device=device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def prompt_mask(seq: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab_size] bools on device: the tokens of seq's prompt, made once (a byte a vocabulary
    token). Counted from the list every step, a greedy step of 16 penalized 8k-token requests took
    157 ms on a 2-core CPU, 12 ms with their masks."""
    mask = seq.prompt_mask
    if mask is None or mask.device != device or len(mask) != vocab_size:
        ids = torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.long, device=device)
        mask = seq.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device).index_fill_(0, ids, True)
    return mask


def apply_penalties(
    logits: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_ids: list[list[int]],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (CTRL-style: divide positive logits, multiply negative ones) on tokens
    seen in prompt (prompt_seen: [M, vocab] bools, prompt_mask's) or output; presence and frequency
    penalties (OpenAI-style) on output tokens. repetition, presence, frequency: [M] per-row values."""
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab_size, logits.device)
    seen = prompt_seen | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * (output_counts > 0)


# Top-k and top-p look at each row's best few tokens first (topk: on a CPU a full sort of SmolLM2's
# 49k vocabulary took 3.6 ms a row, topk(256) 0.2 ms); the rows whose top-p mass reaches past them
# take the next width, and the last is a whole sort.
CANDIDATES = (256, 4096)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf what min-p, top-k (0 = off) and top-p rule out, in that order (vLLM's); per-row
    values of shape [M]. Min-p cuts the whole distribution; top-p keeps the smallest prefix, best
    first, whose mass reaches top_p, of the distribution renormalized over what min-p and top-k left."""
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    log_norm = logits.logsumexp(dim=-1)
    out = logits.clone()  # rows no cut touches stay as they are
    pending = ((top_k > 0) | (top_p < 1.0)).nonzero().flatten()
    for width in (*CANDIDATES, vocab_size):
        k, p = top_k[pending], top_p[pending]
        width = min(vocab_size, max(width, int(k.max())))
        rows = logits[pending]
        ranked, order = rows.topk(width, dim=-1) if width < vocab_size else rows.sort(dim=-1, descending=True)
        kept, mass = _cut_ranked(ranked, k, p, log_norm[pending])
        # Settled: top-k bounds the row within the width, or top-p's prefix ends inside it.
        done = (k > 0) | (mass >= p) | (width == vocab_size)
        out[pending[done]] = torch.full_like(rows[done], float("-inf")).scatter_(1, order[done], kept[done])
        pending = pending[~done]
        if not len(pending):
            break
    return out


def _cut_ranked(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                log_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ranked: rows' best logits, best first (all of a row's, or its first few); log_norm: the log of
    each whole row's softmax denominator. Returns ranked with -inf where top-k or top-p cuts, and
    each row's probability mass within `ranked` (over its top k where top-k is on)."""
    width = ranked.shape[-1]
    ranks = torch.arange(width, device=ranked.device).unsqueeze(0)
    ranked = ranked.masked_fill(ranks >= torch.where(top_k > 0, top_k, width).unsqueeze(1), float("-inf"))
    log_norm = torch.where(top_k > 0, ranked.logsumexp(dim=-1), log_norm)
    probs = (ranked - log_norm.unsqueeze(1)).exp()
    mass = probs.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p. The first token always stays, even for a
    # top_p that is 0 in float32 (1e-300 passes validation), or every logit would be -inf.
    cut = (mass - probs >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1) & (ranks > 0)
    return ranked.masked_fill(cut, float("-inf")), mass[:, -1]


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for output position `position`: a function of the two
    alone (a multiplicative hash keeps seed + j, choice j of `n`, apart from seed's positions).
    The high half is folded into the low one: a CPU generator keeps only a seed's low 32 bits,
    and seeds 2^32 apart gave the same text."""
    mixed = ((seed & MASK64) * 0x9E3779B97F4A7C15 + position) & MASK64
    return (mixed ^ (mixed >> 32)) & (MASK64 >> 1)


def _exponential_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill t with Exp(1) noise as -log(U), U ~ Uniform(0, 1): on a CPU 6x faster than torch's
    exponential_ (68 -> 12 ms for 64 rows of 49k). U = 0 (one draw in 2^24) is raised to the
    smallest float: its +inf noise made a row whose filters left one token all zeros, and the
    draw token 0, a token the filters or a grammar had ruled out."""
    return t.uniform_(generator=generator).clamp_min_(torch.finfo(t.dtype).tiny).log_().neg_()


def _seeded_rows(seqs: list[Sequence]) -> Iterator[tuple[int, Sequence, int]]:
    """(row, sequence, the output position its token takes) for each row of a seeded request: a
    sequence checking drafts has its rows in a run, the first deciding the token after its checked ones."""
    seen: dict[int, int] = {}
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            offset = seen[id(seq)] = seen.get(id(seq), -1) + 1
            yield i, seq, seq.num_output_tokens - seq.num_draft_tokens + offset


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax):
        """argmax: rows [M, V] -> first index of each row's maximum (the backend's; torch's CPU
        argmax over the vocabulary is slow enough to show at decode)."""
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.argmax = argmax
        self.warned_non_finite = False

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 drafts: list[int] | None = None) -> tuple[list[int], list[dict[str, Any] | None]]:
        """logits: [M, vocab] float32, one row per sequence (a sequence checking speculative drafts
        has a row per draft and one more). drafts: per row, the draft token it checks, or -1.
        Returns the tokens and, per row, its logprob entry (None when it asked for none). Every
        row draws its token as plain decoding would; the engine keeps drafts up to the first row
        that returned another token. For a proposal that is one token with certainty this is
        speculative sampling exactly: a draft is kept with probability p(draft), and where it is
        not, the token is a draw from p without it."""
        params = [seq.params for seq in seqs]
        greedy = [p.greedy for p in params]
        # Drawn before the logits are looked at, so that a second pass over clamped logits (below)
        # uses the same noise: the engine's generator advances once per step either way.
        noise = None if all(greedy) else self._noise(logits, seqs)
        bounds = torch.stack(torch.aminmax(logits)).double()  # one pass over the logits
        tokens, logprobs = self._sample(logits, seqs, params, greedy, noise, drafts)
        # One host copy, the step's one sync on a GPU: the logits' range and the tokens together.
        low, high, *drawn = torch.cat([bounds, tokens.double()]).tolist()
        if -LOGIT_LIMIT <= low and high <= LOGIT_LIMIT:  # NaN fails both comparisons
            token_list = [int(token) for token in drawn]
        else:  # a broken model: the tokens come from its logits made finite
            self._warn_non_finite(logits, seqs)
            tokens, logprobs = self._sample(finite_logits(logits), seqs, params, greedy, noise, drafts)
            token_list = tokens.tolist()
        return token_list, self._logprob_entries(logprobs, token_list, params)

    def _warn_non_finite(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        if not self.warned_non_finite:
            broken = (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()
            if broken:  # warned once: it is the model (or its dtype) that is broken, not a request
                self.warned_non_finite = True
                log.warning("the model produced NaN or infinite logits (request %s); sampling clamps them, "
                            "but the output is unlikely to mean anything", seqs[broken[0]].request_id)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams], greedy: list[bool],
                noise: torch.Tensor | None, drafts: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens (on the device) and, if any row asked for logprobs, the raw log-probabilities.
        Nothing here changes state that a second call would see (constrain gives drafts back)."""
        logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        if any(p.logit_bias for p in params):  # before the penalties, as vLLM: a penalty scales the biased logit
            logits = self._biased(logits, params)
        if any(p.penalized for p in params):
            logits = finite_logits(apply_penalties(
                logits,
                torch.stack([prompt_mask(seq, logits.shape[-1], logits.device) for seq in seqs]),
                [seq.output_token_ids for seq in seqs],
                self._column(params, "repetition_penalty"),
                self._column(params, "presence_penalty"),
                self._column(params, "frequency_penalty"),
            ))
        if any(seq.matcher is not None for seq in seqs):
            logits = constrain(logits, seqs, drafts)
        if any(not seq.may_stop for seq in seqs):
            logits = self._without_stops(logits, seqs)
        if noise is None:  # all greedy: no filtering, no noise
            return self.argmax(logits), logprobs
        return self._draw(logits, params, greedy, noise), logprobs

    def _biased(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """logits + each row's logit_bias (a new tensor: the model's logits stay as they were)."""
        rows, cols, bias = zip(*((i, token, b) for i, p in enumerate(params)
                                 for token, b in (p.logit_bias or {}).items()))
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        return logits.index_put(index, torch.tensor(bias, dtype=logits.dtype, device=logits.device), accumulate=True)

    @staticmethod
    def _without_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """min_tokens: rows that may not stop yet cannot draw EOS or a stop token (a new tensor),
        unless nothing else is left: a structured output whose answer is complete allows only EOS,
        and ends there (the grammar wins over min_tokens; a row of -inf would draw token 0)."""
        vocab = logits.shape[1]  # a stop token id beyond the vocabulary is never drawn anyway
        held = [(i, token) for i, seq in enumerate(seqs) if not seq.may_stop
                for token in seq.stop_token_ids if token < vocab]
        if not held:  # ignore_eos and no stop tokens: nothing to hold
            return logits
        rows, cols = zip(*held)
        index = (torch.tensor(rows, dtype=torch.int64, device=logits.device),
                 torch.tensor(cols, dtype=torch.int64, device=logits.device))
        held_logits = logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
        stuck = torch.isneginf(held_logits).all(dim=-1, keepdim=True)
        return torch.where(stuck, logits, held_logits)

    def _column(self, params: list[SamplingParams], name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=self.device)

    def _noise(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exp(1) noise per logit: from the engine's generator, a seeded row's from its own."""
        noise = _exponential_(torch.empty_like(logits), self.generator)
        for i, seq, position in _seeded_rows(seqs):
            seq.generator.manual_seed(position_seed(seq.params.seed, position))
            _exponential_(noise[i], seq.generator)
        return noise

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], greedy: list[bool],
              noise: torch.Tensor) -> torch.Tensor:
        greedy_mask = torch.tensor(greedy, device=self.device)
        temperature = self._column(params, "temperature").masked_fill(greedy_mask, 1.0)
        scaled = filter_logits(
            logits / temperature.unsqueeze(1),
            self._column(params, "top_k", torch.int64),
            self._column(params, "top_p"),
            self._column(params, "min_p"),
        )
        drawn = self.argmax(scaled.softmax(dim=-1) / noise)
        return torch.where(greedy_mask, self.argmax(logits), drawn) if any(greedy) else drawn

    @staticmethod
    def _logprob_entries(
        logprobs: torch.Tensor | None, tokens: list[int], params: list[SamplingParams]
    ) -> list[dict[str, Any] | None]:
        if logprobs is None:
            return [None] * len(tokens)
        top_n = max(p.logprobs or 0 for p in params)
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
        # One host copy each for the whole batch, not two per row (on a GPU each is a sync).
        top_ids, top_values = (top_ids.tolist(), top_values.tolist()) if top_n else ([], [])
        entries: list[dict[str, Any] | None] = []
        for i, (token, p) in enumerate(zip(tokens, params)):
            if p.logprobs is None:
                entries.append(None)
                continue
            n = p.logprobs
            top = list(zip(top_ids[i][:n], top_values[i][:n])) if n else []
            entries.append({"token_id": token, "logprob": chosen[i], "top": top})
        return entries
