"""Prompt logprobs (vLLM's `prompt_logprobs`): how the model scores the prompt it was given.

For each prompt position i >= 1: the logprob of the prompt's own token i given tokens < i, its
rank, and the top-k tokens there. Tokens are ordered as greedy decoding prefers them: a greater
logit first, and among equal logits the lower id (argmax takes the first). The rank is 1 + the
number of tokens ordered before it, so no two tokens share a rank and rank 1 is exactly the token
greedy decoding emits (teacher-forced greedy agreement is the share of rank-1 positions). vLLM
counts only strictly greater logits, so tied tokens share its ranks; without ties both agree.
The top k are the first k tokens in that order, ranked 1..k.

Only requests that ask pay for this: the runner computes logits for their prompt rows alone, at
most LOGITS_BUDGET floats of them at a time, and keeps just these figures, never a prompt's
full logits (prompt length x vocabulary floats).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kiln.engine.sampler import finite_logits

# Logits alive at once while scoring prompt rows: 64 MiB in float32.
LOGITS_BUDGET = 1 << 24

# One prompt position's entry: {token id: {"logprob": float, "rank": int, "decoded_token": str}}.
PromptLogprob = dict[int, dict[str, Any]]


@dataclass
class ScoredPosition:
    token_id: int  # the prompt's token at this position
    logprob: float
    rank: int
    top: list[tuple[int, float, int]]  # the top-k (token id, logprob, rank), best first


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, LOGITS_BUDGET // vocab_size)


def score_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               targets: list[int], k: int, chunk: int) -> list[ScoredPosition]:
    """Score targets[j], the token that follows row j of hidden (one row per position), with the
    top k; logits for `chunk` rows at a time."""
    scored: list[ScoredPosition] = []
    for lo in range(0, len(targets), chunk):
        scored += _score(compute_logits(hidden[lo:lo + chunk]), targets[lo:lo + chunk], k)
    return scored


def _score(logits: torch.Tensor, targets: list[int], k: int) -> list[ScoredPosition]:
    """logits [R, vocab] float32 -> the R targets' figures. Non-finite logits are bounded as for
    sampling (sampler.finite_logits): a NaN would make every figure of its row NaN, which JSON
    cannot carry."""
    index = torch.tensor(targets, device=logits.device).unsqueeze(1)
    nan_target = logits.gather(1, index).isnan().squeeze(1)
    logits = finite_logits(logits)
    log_norm = logits.logsumexp(-1, keepdim=True)
    target_logits = logits.gather(1, index)
    # A NaN logit is never preferred, so its token ranks last. In a row of NaNs every bounded
    # logit ties and would rank first: a broken canary would "agree" with every token.
    ranks = torch.where(nan_target, logits.shape[-1], _ranks(logits, index).squeeze(1))
    top_logits, top_ids = _top(logits, k)
    # The first k in rank order rank 1..k: no pass over the vocabulary per alternative.
    top_ranks = torch.arange(1, k + 1, device=logits.device).expand(len(targets), k)
    rows = zip(targets, (target_logits - log_norm).squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(),
               (top_logits - log_norm).tolist(), top_ranks.tolist())
    return [ScoredPosition(t, lp, r, list(zip(ids, lps, rks))) for t, lp, r, ids, lps, rks in rows]


def _ranks(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids [R, 1] -> their ranks [R, 1]: 1 + the tokens greedy decoding prefers to each, a greater
    logit or an equal one at a lower id. Rank 1 is greedy's token: with ties sharing it, a canary
    whose logits were all equal (or all +inf) "agreed" with every token."""
    own = logits.gather(1, ids)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    return 1 + ((logits > own) | ((logits == own) & (vocab < ids))).sum(-1, keepdim=True)


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k tokens of each row in rank order (see _ranks), best first: (logits, ids) [R, k]."""
    vocab = logits.shape[-1]
    values, ids = logits.topk(min(k + 1, vocab) if k else 0, dim=-1)
    # topk's values are right, but among tokens tied at the k-th it picks any: where the (k+1)-th
    # ties with the k-th, a stable sort of the row (rare; all of it) takes the lower ids.
    if 0 < k < vocab:
        tied = (values[:, k - 1] == values[:, k]).nonzero().squeeze(1)
        if tied.numel():
            row_values, row_ids = logits[tied].sort(dim=-1, descending=True, stable=True)
            values[tied], ids[tied] = row_values[:, :k + 1], row_ids[:, :k + 1]
    values, ids = values[:, :k], ids[:, :k]
    # Within the k, equal logits in id order: sort by id, then stably by logit.
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def entry(scored: ScoredPosition, decode: Callable[[int], str]) -> PromptLogprob:
    """The prompt token first, then the top-k; a token in both appears once."""
    out: PromptLogprob = {}
    for token_id, logprob, rank in [(scored.token_id, scored.logprob, scored.rank), *scored.top]:
        if token_id not in out:
            out[token_id] = {"logprob": logprob, "rank": rank, "decoded_token": decode(token_id)}
    return out
