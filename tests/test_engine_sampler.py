"""Sampler and SamplingParams against direct torch computations (no model needed)."""
from __future__ import annotations

import pytest
import torch

from kiln.engine import sampler as sampler_module
from kiln.engine.sampler import Sampler, apply_penalties, filter_logits, finite_logits
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence

VOCAB = 50


def make_seqs(params: list[SamplingParams], prompt: list[int] | None = None, output: list[int] | None = None) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(str(i), prompt or [1, 2, 3], p, i)
        for t in output or []:
            seq.append_token(t)
        if p.seed is not None:
            seq.generator = torch.Generator().manual_seed(p.seed)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": True}, "top_k"),  # bools are ints to Python: True passed as 1
        ({"seed": True}, "seed"),
        ({"logprobs": True}, "logprobs"),
        ({"stop_token_ids": [False]}, "stop_token_ids"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_minus_one_is_off_as_in_vllm() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None, min_tokens=10**6).max_tokens is None  # until the context ends


def test_penalties_match_definition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    prompts, outputs = [[1, 2, 3], [4]], [[3, 3, 5], []]
    rep, pres, freq = torch.tensor([1.3, 0.7]), torch.tensor([0.5, -0.4]), torch.tensor([0.25, 1.0])
    seen = torch.zeros(2, VOCAB, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        seen[i, prompt] = True
    got = apply_penalties(logits, seen, outputs, rep, pres, freq)
    expected = logits.clone()
    for i in range(2):
        for t in range(VOCAB):
            if t in prompts[i] or t in outputs[i]:
                x = expected[i, t]
                expected[i, t] = x / rep[i] if x > 0 else x * rep[i]
            n = outputs[i].count(t)
            expected[i, t] -= freq[i] * n + pres[i] * (n > 0)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, logits)


def test_a_penalized_sequence_makes_its_prompt_mask_once() -> None:
    """The prompt's tokens were counted from the list again every step (a greedy step of 16 penalized
    8k-token requests took 157 ms on a 2-core CPU); now once a sequence, and the penalty is the same."""
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    (seq,) = make_seqs([params], prompt=[int(logits.argmax()), 5, 5])
    tokens, _ = Sampler()(logits.clone(), [seq])
    made = seq.prompt_mask
    assert made.nonzero().flatten().tolist() == sorted({int(logits.argmax()), 5})
    expected = apply_penalties(logits, made[None], [[]], torch.tensor([3.0]), torch.zeros(1), torch.zeros(1))
    assert tokens == [int(expected.argmax())] and tokens != [int(logits.argmax())]
    seq.append_token(tokens[0])
    Sampler()(logits.clone(), [seq])
    assert seq.prompt_mask is made


def test_filters_keep_the_right_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = filter_logits(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.8, 1.0]), torch.tensor([0.0, 0.0, 0.2]))
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True, True, False, False]  # top_k=2
    assert kept[1] == [True, True, False, False]  # top_p=0.8: 0.5+0.3 reaches it
    assert kept[2] == [True, True, True, False]  # min_p=0.2: floor 0.1
    torch.testing.assert_close(out[0, :2], logits[0, :2])  # survivors keep their values


def test_min_p_cuts_before_top_p_renormalizes_as_in_vllm() -> None:
    """Min-p ran after top-p, which then took its mass over tokens min-p was to drop: with top_p 0.8
    and min_p 0.25 the 0.15 token was drawn about one time in five. vLLM cuts min-p first."""
    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log()
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([0.8]), torch.tensor([0.25]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False]]  # 0.7 of 0.7 reaches 0.8


def test_logit_bias_is_added_before_the_penalties_as_in_vllm() -> None:
    """A repetition penalty scales the biased logit: (10 + 5) / 2 = 7.5 loses to 9. Added after
    it, 10 / 2 + 5 = 10 won."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0], logits[0, 1] = 10.0, 9.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 5.0})
    tokens, _ = Sampler()(logits, make_seqs([params], prompt=[0]))
    assert tokens == [1]


def sorted_filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p by sorting the whole row: the reference for the candidates' shortcut."""
    order = row.argsort(descending=True)
    kept = order[:top_k] if top_k > 0 else order
    probs = row[kept].softmax(dim=-1)
    if top_p < 1.0:
        kept = kept[probs.cumsum(dim=0) - probs < top_p]
    return torch.full_like(row, -INF).index_put_((kept,), row[kept])


@pytest.mark.parametrize("candidates", [(16,), (16, 256), sampler_module.CANDIDATES])
def test_top_k_top_p_over_candidates_match_a_whole_sort(candidates: tuple[int, ...],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k/top-p look at each row's best logits, widening (CANDIDATES) for the rows whose top-p mass
    lies past them, a flat row's, to a whole sort. Either way the kept tokens and values are a whole
    sort's, for peaked and flat rows, rows with -inf, top-k beyond the candidates, and rows nothing cuts."""
    monkeypatch.setattr(sampler_module, "CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(3)
    vocab = 3000
    peaked = torch.randn(4, vocab, generator=gen) * 4
    flat = torch.randn(4, vocab, generator=gen) * 0.1
    logits = torch.cat([peaked, flat])
    logits[1, ::3] = -INF  # e.g. a grammar's mask
    top_k = torch.tensor([0, 0, 5, 40, 0, 0, 2000, 0])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.9, 1.0, 0.99, 0.3])
    out = filter_logits(logits, top_k, top_p, torch.zeros(8))
    for i in range(8):
        expected = sorted_filter(logits[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(out[i], expected), f"row {i}: {torch.isfinite(out[i]).sum()} kept, " \
                                              f"{torch.isfinite(expected).sum()} expected"
    assert torch.equal(out[5], logits[5])  # neither cut: the row as it was
    assert torch.isfinite(out[4]).sum() > 256  # a flat row: its top-p prefix is longer than 256 candidates


def test_a_top_p_below_float32s_range_keeps_the_best_token() -> None:
    """top_p=1e-300 passes validation but is 0 in float32: the best token must still stay, and be
    the one sampled (before, every logit was cut and the NaN softmax drew token 0 each step)."""
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    logits[:, 0] = -5.0  # token 0 is no one's best
    out = filter_logits(logits, torch.tensor([0, 0]), torch.tensor([1e-300, 1e-300], dtype=torch.float32),
                        torch.zeros(2))
    assert torch.isfinite(out).sum(dim=-1).tolist() == [1, 1]
    assert out.argmax(-1).tolist() == logits.argmax(-1).tolist()
    tokens, _ = Sampler(seed=0)(logits, make_seqs([SamplingParams(temperature=1.0, top_p=1e-300)] * 2))
    assert tokens == logits.argmax(-1).tolist()


def test_greedy_top_k_one_and_logprobs() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    sampler = Sampler(seed=0)
    greedy, _ = sampler(logits, make_seqs([SamplingParams(temperature=0)] * 3))
    assert greedy == logits.argmax(-1).tolist()
    top1, _ = sampler(logits, make_seqs([SamplingParams(temperature=1.5, top_k=1)] * 3))
    assert top1 == greedy
    tokens, entries = sampler(logits, make_seqs([SamplingParams(temperature=0.8, logprobs=3)] * 3))
    reference = logits.log_softmax(-1)
    for i, entry in enumerate(entries):
        assert entry["token_id"] == tokens[i]
        assert entry["logprob"] == pytest.approx(reference[i, tokens[i]].item(), abs=1e-5)
        values, ids = reference[i].topk(3)
        assert [t for t, _ in entry["top"]] == ids.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(values.tolist(), abs=1e-5)


def test_logit_bias_moves_the_choice_but_not_the_logprobs() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    top = logits.argmax(dim=-1)
    biases = [{7: 100.0}, {int(top[1]): -100.0, 9: 0.5}, {}]  # force a token, ban the argmax, none
    params = [SamplingParams(temperature=0.0, logprobs=1, logit_bias=b or None) for b in biases]
    tokens, entries = Sampler()(logits.clone(), make_seqs(params))
    reference = logits.clone()
    for row, bias in enumerate(biases):
        for token, b in bias.items():
            reference[row, token] += b
    assert tokens == reference.argmax(dim=-1).tolist() and tokens[0] == 7 and tokens[1] != int(top[1])
    assert tokens[2] == int(top[2])
    raw = logits.log_softmax(dim=-1)
    for row, entry in enumerate(entries):
        assert entry["logprob"] == pytest.approx(raw[row, tokens[row]].item(), abs=1e-5)  # the model's own
    # Sampled rows see the bias too: a token at -100 is never drawn, one at +100 always is.
    drawn = [Sampler(seed)(logits[:1].clone(), make_seqs([SamplingParams(temperature=1.0, logit_bias={4: 100.0})]))[0][0]
             for seed in range(20)]
    assert drawn == [4] * 20


def test_min_tokens_holds_back_the_stop_tokens_only_until_reached() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    top = logits.argmax(dim=-1).tolist()
    # Row 0 would stop (its argmax is a stop token) but has 1 of 2 tokens; row 1 has its 2;
    # row 2 would stop on a token beyond the vocabulary (never drawn: nothing to hold).
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[top[0], VOCAB + 5]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[top[1]]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[VOCAB + 5])]
    seqs = make_seqs(params[:1], output=[7]) + make_seqs(params[1:2], output=[7, 8]) + make_seqs(params[2:], output=[7])
    seqs[0].stop_token_ids |= {3}  # as the engine adds the model's EOS
    tokens, _ = Sampler()(logits.clone(), seqs)
    held = logits[0].clone()
    held[[top[0], 3]] = float("-inf")
    assert tokens == [int(held.argmax()), top[1], top[2]] and tokens[0] != top[0]
    # Drawn rows too: with the stop tokens made likeliest, 30 draws never take one.
    hot = logits[:1].clone()
    hot[0, [top[0], 3]] = 20.0
    sampled = make_seqs([SamplingParams(min_tokens=2, stop_token_ids=[top[0], 3])], output=[7])
    assert not {Sampler(seed)(hot.clone(), sampled)[0][0] for seed in range(30)} & {top[0], 3}


def test_checking_a_draft_keeps_the_distribution() -> None:
    """Speculative sampling with a one-token proposal: the draft comes back with probability
    p(draft), else a draw from the rest; either way each token's frequency is its softmax
    probability (4000 rows, one draw each; the tolerance is ~5 standard errors)."""
    torch.manual_seed(5)
    logits = torch.randn(VOCAB) * 1.5
    probs = logits.softmax(-1)
    draft = int(probs.argsort()[-3])  # likely enough to be accepted often, not always
    rows = 4000
    params = [SamplingParams(temperature=1.0)] * rows
    tokens, _ = Sampler(seed=1)(logits.expand(rows, VOCAB).clone(), make_seqs(params), [draft] * rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / rows
    assert (freq - probs).abs().max() < 5 * (probs * (1 - probs) / rows).sqrt().max()
    assert 0.5 * probs[draft] < freq[draft] < 1.5 * probs[draft]
    # A draft the filters rule out (top_k=1 keeps only the argmax) is never accepted; greedy rows
    # and rows with no draft (-1) are unaffected.
    top = int(probs.argmax())
    mixed = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.0), SamplingParams(top_k=1)]
    out, _ = Sampler(seed=2)(logits.expand(3, VOCAB).clone(), make_seqs(mixed), [draft, draft, -1])
    assert out == [top, top, top]


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)

    def draw(seed: int, neighbours: int) -> list[int]:
        sampler = Sampler(seed=neighbours)  # the engine's own generator differs run to run
        params = [SamplingParams(temperature=1.0, seed=seed)] + [SamplingParams(temperature=1.0)] * neighbours
        seqs = make_seqs(params)
        batch = logits.repeat(1 + neighbours, 1)
        tokens = []
        for _ in range(20):  # 20 output positions
            tokens.append(sampler(batch, seqs)[0][0])
            seqs[0].append_token(tokens[-1])
        return tokens

    assert draw(7, 0) == draw(7, 3)
    assert draw(7, 0) != draw(8, 0)
    # A CPU generator keeps a seed's low 32 bits alone: seeds 2^32 or 2^63 apart were one seed.
    assert draw(7, 0) != draw(7 + 2**32, 0) and draw(-7, 0) != draw(2**63 - 7, 0)


def test_a_uniform_draw_of_zero_never_picks_a_filtered_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """U = 0 (one float32 draw in 2^24) made -log(U) infinite: in a row that top_k=1 left one
    token, every p / noise was 0 and the draw was token 0."""
    logits = torch.randn(1, VOCAB)
    logits[0, 7] = 5.0
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, **_: self.zero_())
    tokens, _ = Sampler(seed=0)(logits, make_seqs([SamplingParams(temperature=1.0, top_k=1)]))
    assert tokens == [7]


def test_a_seeded_draw_depends_on_its_output_position_alone() -> None:
    """The row deciding output position 2 draws the same token whether the sequence decodes it
    plainly or checks it as the second of its rows (behind a draft for position 1)."""
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=11)
    plainly = make_seqs([params], output=[5, 6])
    drafting = make_seqs([params], output=[5])
    drafting[0].add_drafts([6])
    for seed in range(8):  # the engine's own generator is never what a seeded row draws from
        got, _ = Sampler(seed)(logits.repeat(2, 1), drafting * 2, [6, -1])
        assert got[1] == Sampler(seed + 100)(logits.clone(), plainly)[0][0]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3)])
    sampler = Sampler(seed=0)
    seqs = make_seqs([SamplingParams(temperature=1.0)] * 4000)
    tokens, _ = sampler(probs.log().repeat(4000, 1), seqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=3)[:3].float() / 4000
    torch.testing.assert_close(freq, probs[0, :3], atol=0.03, rtol=0)


NAN, INF = float("nan"), float("inf")


def test_non_finite_logits_give_valid_tokens_and_finite_logprobs(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(3)
    clean = torch.randn(5, VOCAB) * 3
    broken = clean.clone()
    broken[0] = NAN  # a whole row lost (overflowed activations)
    broken[1, clean[1].argmax()] = NAN  # one NaN where the best token was
    broken[2, 7] = INF
    broken[3] = -INF  # everything masked
    broken[4, :10] = -INF
    samplings = {
        "greedy": SamplingParams(temperature=0, logprobs=3),
        "plain": SamplingParams(temperature=1.0, logprobs=3, seed=1),
        "filtered": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3, seed=1),
        "penalized": SamplingParams(temperature=0.9, repetition_penalty=1e-30, frequency_penalty=2.0, logprobs=3, seed=1),
    }
    for name, p in samplings.items():
        caplog.clear()
        sampler = Sampler(seed=0)
        with caplog.at_level("WARNING", logger="kiln.engine.sampler"):
            tokens, entries = sampler(broken, make_seqs([p] * 5, output=[7, 7]))
            sampler(broken, make_seqs([p] * 5))
        print(name, tokens, [round(e["logprob"], 1) for e in entries])
        assert all(0 <= t < VOCAB for t in tokens)
        assert all(torch.isfinite(torch.tensor([e["logprob"]] + [v for _, v in e["top"]])).all() for e in entries)
        assert tokens[1] != clean[1].argmax().item()  # the NaN token is never preferred
        assert tokens[4] >= 10  # -inf stays out of reach while anything finite is left
        assert len(caplog.records) == 1 and "request 0" in caplog.text  # warned once, naming a broken request
    greedy, _ = Sampler()(broken, make_seqs([SamplingParams(temperature=0)] * 5))
    assert greedy[2] == 7  # +inf is the clear favourite, as it was


def test_probabilities_are_never_nan() -> None:
    rows = torch.tensor([[NAN] * 4, [-INF] * 4, [INF, INF, 0.0, 1.0], [NAN, -INF, INF, 2.0]])
    for top_k, top_p, min_p in ((0, 1.0, 0.0), (2, 0.5, 0.3)):
        n = len(rows)
        out = filter_logits(finite_logits(rows) / 1e-5, torch.full((n,), top_k), torch.full((n,), top_p),
                            torch.full((n,), min_p))
        probs = out.softmax(dim=-1)
        assert not probs.isnan().any(), probs
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(n))


def count_host_copies(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts conversions of tensors to host values (on a GPU, each waits for the device)."""
    seen = {"copies": 0}
    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
        def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
            seen["copies"] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    return seen


def test_one_host_copy_per_greedy_step_and_logprobs_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(dim=-1).tolist()
    seen = count_host_copies(monkeypatch)
    tokens, _ = Sampler()(logits, make_seqs([SamplingParams(temperature=0)] * 8))
    assert tokens == want and seen["copies"] == 1  # the logits' range and the tokens, together
    copies = []
    for rows in (2, 8):  # logprob entries cost the same host copies for any number of rows
        seen["copies"] = 0
        _, entries = Sampler()(logits[:rows], make_seqs([SamplingParams(temperature=0, logprobs=3)] * rows))
        assert [len(e["top"]) for e in entries] == [3] * rows
        copies.append(seen["copies"])
    assert copies[0] == copies[1], copies


def test_clamped_logits_draw_as_finite_ones_would() -> None:
    """A step whose logits need clamping samples again from the clamped ones with the same noise:
    the tokens, and the engine generator's next draws, are those of finite logits from the start."""
    broken = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    broken[1, 3], broken[2, 5] = NAN, INF
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=4)]
    for seed in range(5):
        clamped, clean = Sampler(seed), Sampler(seed)
        assert clamped(broken.clone(), make_seqs(params))[0] == clean(finite_logits(broken), make_seqs(params))[0]
        nxt = finite_logits(broken)
        assert clamped(nxt.clone(), make_seqs(params))[0] == clean(nxt.clone(), make_seqs(params))[0]
