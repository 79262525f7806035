"""The Llama model, the torch attention backend and the tokenizer, against references:
HF transformers (same GGUF, same HF folders) and a naive dense attention."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from kiln.engine.attention import paged_attention, store_kvcache
from kiln.engine.config import Config, ModelLoadError, resolve_max_model_len
from kiln.engine.context import Context, prefill_context, reset_context, set_context
from kiln.engine.loader import load_model, read_hf_config
from kiln.engine.lora import lora_mapping
from kiln.engine.tokenizer import IncrementalDetokenizer

TEXTS = ["Hello world!", "The capital of France is", "café naïve — 日本語のテキスト 🚀🔥👩‍👩‍👧",
         "  two leading spaces\n\ttab and newline", "numbers 12345, 3.14159 and 2024-11-22",
         "<|im_start|>user\nspecial tokens stay whole<|im_end|>", "def f(x):\n    return x ** 2  # code"]


def forward_prefill(model, prompts: list[list[int]], adapters: list | None = None) -> torch.Tensor:
    """Logits of every token of several prompts run as one flattened batch, no KV cache; prompt i
    with the LoRA adapter adapters[i] (kiln.engine.lora), if given."""
    context = prefill_context([len(p) for p in prompts])
    if adapters is not None:
        context.lora = lora_mapping([(a, len(p)) for a, p in zip(adapters, prompts)], torch.device("cpu"))
    set_context(context)
    try:
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions))
    finally:
        reset_context()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_smollm2_logits_match_transformers(smollm2_fp32, hf_smollm2) -> None:
    hf_model, _ = hf_smollm2
    prompts = [smollm2_fp32.tokenizer.encode(t) for t in TEXTS[:3]]
    logits = forward_prefill(smollm2_fp32.model, prompts)
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, prompts)), 49152)
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0]
        assert rel_err(logits[start:start + len(prompt)], ref) < 1e-3
        start += len(prompt)


def test_smollm2_tokenizer_matches_transformers(smollm2_fp32, hf_smollm2) -> None:
    _, hf_tok = hf_smollm2
    for text in TEXTS:
        ids = smollm2_fp32.tokenizer.encode(text)
        assert ids == hf_tok(text).input_ids, text
        assert smollm2_fp32.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm2_fp32.tokenizer.eos_token_ids == [hf_tok.eos_token_id] == [2]
    assert smollm2_fp32.tokenizer.encode("<|im_end|>") == [2]


def test_smollm2_chat_template_matches_transformers(smollm2_fp32, hf_smollm2) -> None:
    _, hf_tok = hf_smollm2
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 👋"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = smollm2_fp32.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.startswith("<|im_start|>system\n")


@pytest.mark.parametrize("prefill", ["<", "end", "m", "Sure, here is", "two spaces  ", ""])
def test_continue_final_message_matches_transformers(smollm2_fp32, hf_smollm2, prefill: str) -> None:
    """The reply begun for the model is cut after its text, even where that text ("<", "m") also
    occurs in the end-of-turn marker the template writes after it."""
    _, hf_tok = hf_smollm2
    messages = [{"role": "user", "content": "Write HTML"}, {"role": "assistant", "content": prefill}]
    ours = smollm2_fp32.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                      continue_final_message=True)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\n" + prefill)


def test_continue_final_message_a_template_leaves_out_is_refused(smollm2_fp32) -> None:
    users_only = smollm2_fp32.tokenizer.with_chat_template(
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="leaves out the final message's text"):
        users_only.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                                       add_generation_prompt=False, continue_final_message=True)


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "description": "café"}}}}}]


def test_named_chat_templates_and_template_helpers_render_as_in_transformers(tmp_path: Path, tiny_hf_models,
                                                                             hf_smollm2) -> None:
    """A tokenizer_config.json's named templates: "tool_use" for requests with tools (Hermes-2-Pro,
    Command-R ship theirs so), "default" otherwise; tojson's options and the {% generation %}
    block of assistant-only-loss templates, against transformers rendering the same folder."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "named"
    shutil.copytree(tiny_hf_models["llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                                        "{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}|"
                                         "{{ tools | tojson(ensure_ascii=true, indent=1) }}|{{ messages[0].content }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    ours = load_model(Config(model=str(folder), dtype="float32", device="cpu")).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "w1"}]
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(messages, tools=tools) == \
            theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == "w1"  # the default: tools are not asked for
    assert ours.apply_chat_template(messages, tools=TOOLS).startswith('[{"function":{"name":"weather"')


def test_incremental_detokenizer_never_splits_a_character(smollm2_fp32) -> None:
    tokenizer = smollm2_fp32.tokenizer
    text = "Grüße 🚀🔥 日本 👩‍👩‍👧 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some emoji span several tokens: held back until complete


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_folder_logits_match_transformers(tiny_hf_models: dict[str, Path], kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    folder = tiny_hf_models[kind]
    loaded = load_model(Config(model=str(folder), dtype="float32", device="cpu"))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 7)]
    logits = forward_prefill(loaded.model, prompts)
    with torch.no_grad():
        ref = torch.cat([ref_model(torch.tensor([p])).logits[0] for p in prompts])
    assert rel_err(logits, ref) < 1e-4
    assert loaded.model_config.attention_bias == (kind == "qwen2")
    assert loaded.model_config.tie_word_embeddings == (kind == "qwen2")
    assert loaded.tokenizer.eos_token_ids == [2]
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "w1 w2"}]) == "<s>user w1 w2 assistant"
    assert loaded.tokenizer.encode("w1 w2 zzz") == [4, 5, 0]


def test_a_tiny_model_written_with_other_settings_leaves_the_next_one_as_it_was(tmp_path: Path) -> None:
    """transformers' config wrote rope_theta into TINY_HF_CONFIGS' rope_scaling dict, so every later
    tiny Llama of the session had the first override's rope_theta."""
    from tiny_models import write_tiny_model
    write_tiny_model("llama", tmp_path / "other", rope_theta=5e5)
    config = json.loads((write_tiny_model("llama", tmp_path / "plain") / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 10000.0


def test_a_sliding_window_caps_the_context_where_whole_attention_is_the_same(tmp_path: Path, caplog) -> None:
    """Sliding-window configs (Mistral-7B-v0.1, Qwen2 with use_sliding_window) were refused: whole
    attention is theirs up to the window, so they load with the context capped there."""
    transformers = pytest.importorskip("transformers")
    from tiny_models import write_tiny_model
    folder = write_tiny_model("qwen2", tmp_path / "slides", use_sliding_window=True, sliding_window=16,
                              max_window_layers=0)
    loaded = load_model(Config(model=str(folder), dtype="float32", device="cpu"))
    assert loaded.model_config.max_position_embeddings == 16 and "capped at 16" in caplog.text
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.randint(3, 96, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        assert rel_err(forward_prefill(loaded.model, [prompt]), ref_model(torch.tensor([prompt])).logits[0]) < 1e-4
    with pytest.raises(ValueError, match="max_model_len 17 exceeds the model's maximum of 16"):
        resolve_max_model_len(Config(max_model_len=17), loaded.model_config)
    config = json.loads((folder / "config.json").read_text())
    # Mistral's window needs no switch; Qwen2's none while every layer is under max_window_layers.
    for changes, context in (({"architectures": ["MistralForCausalLM"], "use_sliding_window": None}, 16),
                             ({"max_window_layers": 2}, 512)):
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        assert read_hf_config(folder).max_position_embeddings == context
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": "16"}))
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive number of tokens, got '16'"):
        read_hf_config(folder)


def naive_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_lens: list[int],
                    scale: float) -> torch.Tensor:
    """Dense causal attention, one sequence and one head at a time, in float64."""
    out, start = [], 0
    group = q.shape[1] // ks[0].shape[1]
    for k, v, n in zip(ks, vs, q_lens):
        for i in range(n):
            pos = k.shape[0] - n + i
            rows = []
            for h in range(q.shape[1]):
                scores = (k[:pos + 1, h // group].double() @ q[start + i, h].double()) * scale
                rows.append(scores.softmax(0) @ v[:pos + 1, h // group].double())
            out.append(torch.stack(rows))
        start += n
    return torch.stack(out).float()


def build_paged_batch(seq_lens: list[int], q_lens: list[int], heads: tuple[int, int], dim: int, block_size: int,
                      num_blocks: int, gen: torch.Generator):
    """A random paged cache holding each sequence's K/V in shuffled blocks; unused slots are NaN."""
    hq, hkv = heads
    k_cache = torch.full((num_blocks, block_size, hkv, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens) + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(math.ceil(n / block_size))]
        tables[b, :len(blocks)] = torch.tensor(blocks)
        k, v = torch.randn(n, hkv, dim, generator=gen), torch.randn(n, hkv, dim, generator=gen)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        store_kvcache(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), hq, dim, generator=gen)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, ks, vs


@pytest.mark.parametrize("seq_lens,q_lens", [
    ([17], [17]),  # prefill
    ([9, 33, 5], [9, 33, 5]),  # several prefills
    ([40, 21], [8, 21]),  # chunked prefill over a cached prefix + a prefill
    ([12, 1, 70, 33], [1, 1, 1, 1]),  # decodes
    ([50, 7, 16, 29], [1, 7, 5, 1]),  # mixed: decode, prefill, chunk, decode
])
def test_paged_attention_matches_naive(seq_lens: list[int], q_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    q, k_cache, v_cache, cu, lens, tables, ks, vs = build_paged_batch(seq_lens, q_lens, (6, 2), 16, 8, 40, gen)
    out = paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.25, max(q_lens), max(seq_lens))
    torch.testing.assert_close(out, naive_attention(q, ks, vs, q_lens, 0.25), rtol=1e-4, atol=1e-5)


def test_store_kvcache_skips_negative_slots() -> None:
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kvcache(k, v, k_cache, v_cache, torch.tensor([5, -1, 11]))
    assert torch.equal(k_cache.flatten(0, 1)[5], k[0]) and torch.equal(v_cache.flatten(0, 1)[11], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def test_paged_decode_matches_one_shot_forward(smollm2_fp32) -> None:
    """Chunked prefill then decode through the paged cache == one forward over the whole text."""
    model, cfg = smollm2_fp32.model, smollm2_fp32.model_config
    layers = [layer.self_attn.attn for layer in model.model.layers]
    ids = [smollm2_fp32.tokenizer.encode(t) for t in (TEXTS[2], TEXTS[4])]
    full = [forward_prefill(model, [p]) for p in ids]
    block_size, num_blocks = 4, 32
    cache = torch.zeros(2, len(layers), num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[:24].view(2, 12).to(torch.int32)
    for i, attn in enumerate(layers):
        attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
    # steps: (tokens done before, tokens this step) per sequence; seq 1 joins after seq 0's first chunk
    steps = [[(0, 6)], [(6, 5), (0, 9)], [(11, 1), (9, 1)], [(12, 1), (10, 1)]]
    try:
        for step in steps:
            seqs = list(range(len(step)))
            tok = [ids[s][done:done + n] for s, (done, n) in zip(seqs, step)]
            pos = [list(range(done, done + n)) for done, n in step]
            slots = [int(tables[s, p // block_size]) * block_size + p % block_size for s in seqs for p in pos[s]]
            q_lens = [n for _, n in step]
            set_context(Context(
                cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
                seq_lens=torch.tensor([d + n for d, n in step], dtype=torch.int32),
                max_seqlen_q=max(q_lens), max_seqlen_k=max(d + n for d, n in step),
                slot_mapping=torch.tensor(slots), block_tables=tables[:len(step)]))
            with torch.inference_mode():
                logits = model.compute_logits(model(torch.tensor(sum(tok, [])), torch.tensor(sum(pos, []))))
            start = 0
            for s, (done, n) in zip(seqs, step):
                assert rel_err(logits[start:start + n], full[s][done:done + n]) < 1e-4
                start += n
    finally:
        reset_context()
        for attn in layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
