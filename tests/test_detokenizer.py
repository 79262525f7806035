"""Streaming text at character boundaries (issue 16 item 5), with SmolLM2's real tokenizer and a
real `kiln serve`: a character the model leaves unfinished at the end is flushed (as U+FFFD, as a
full decode shows it) instead of dropped; a prompt ending in half a character has its completion
streamed whole."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from kiln.engine.openai_responses import chat_logprobs, completion_logprobs
from kiln.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from test_server import MODEL, ServerProcess

ROCKETS = "🚀🚀🚀🚀🚀🚀"  # 🚀 is three tokens in SmolLM2 (F0 9F | 9A | 80): easy to cut in half


@pytest.fixture(scope="module")
def tokenizer(smollm2_fp32):
    return smollm2_fp32.tokenizer


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer) -> None:
    ids = tokenizer.encode("Grüße 🚀", add_special_tokens=False)[:-1]  # the rocket's last byte missing
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    tail = detok.flush()
    print("deltas", deltas, "flush", repr(tail))
    assert "".join(deltas) == "Grüße"  # the rest (" " and the rocket's first bytes) held back
    assert tail == " \ufffd" and detok.text == tokenizer.decode(ids)  # flushed, as a full decode shows it
    assert detok.flush() == ""  # nothing twice


def test_a_character_begun_in_the_prompt_comes_out_whole(tokenizer) -> None:
    ids = tokenizer.encode("Grüße 🚀 done", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")
               and tokenizer.decode(ids[:i]).startswith("Grüße "))  # inside the rocket
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])
    deltas = [detok.add([i]) for i in ids[cut:]] + [detok.flush()]
    print("prompt", repr(tokenizer.decode(ids[:cut])), "deltas", deltas)
    assert "".join(deltas) == "🚀 done" and "\ufffd" not in "".join(deltas)
    # A prompt that ends cleanly adds nothing to the first delta.
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Grüße", add_special_tokens=False))
    assert detok.add(tokenizer.encode(" 🚀", add_special_tokens=False)[:1]) == ""
    assert detok.add(tokenizer.encode(" 🚀", add_special_tokens=False)[1:]) == " 🚀"


@pytest.mark.parametrize("prompt", ["Replacement char: \ufffd", "Grüße 🚀"], ids=["a real U+FFFD", "never finished"])
def test_a_prompt_ending_in_u_fffd_adds_nothing_to_the_output(tokenizer, prompt: str) -> None:
    """The prompt's last character is a real U+FFFD, or bytes the output does not finish: either
    way it is the prompt's, and the completion is only the output's text (it was put before it)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = ids if prompt.endswith("\ufffd") else ids[:-1]  # the rocket's last byte cut off
    output = tokenizer.encode(" done", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids)
    assert "".join(detok.add([i]) for i in output) + detok.flush() == " done" == detok.text
    silent = IncrementalDetokenizer(tokenizer, prompt_ids=ids)  # nothing generated (EOS at once)
    assert silent.flush() == ""


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "256", "--kv-cache-memory", "64Mi")
    yield s
    s.stop()


def _stream(server: ServerProcess, prompt, max_tokens: int) -> tuple[list[str], list[int]]:
    chunks = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True})
    texts, token_ids = [], []
    for chunk in chunks:
        texts.append(chunk.choices[0].text)
        token_ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    return [t for t in texts if t], token_ids


def test_the_stream_flushes_an_unfinished_character(server, tokenizer) -> None:
    """Cut off mid-rocket by max_tokens, the stream ends with U+FFFD rather than nothing."""
    for max_tokens in (1, 2, 3):
        texts, token_ids = _stream(server, ROCKETS, max_tokens)
        print(max_tokens, token_ids, texts)
        assert "".join(texts) == tokenizer.decode(token_ids)  # the stream says what the tokens say
    cut_short, _ = _stream(server, ROCKETS, 1)
    assert cut_short == ["\ufffd"]  # was [] before: the unfinished character vanished


def test_a_prompt_ending_in_half_a_character_streams_it_whole(server, tokenizer) -> None:
    prompt_ids = tokenizer.encode(ROCKETS, add_special_tokens=False)[:-2]  # ends after the rocket's first byte
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    texts, token_ids = _stream(server, prompt_ids, 2)
    print("prompt ends", prompt_ids[-3:], "->", token_ids, texts)
    # Greedy SmolLM2 finishes the rocket (the premise; the assertion shows what it did if not).
    assert tokenizer.decode(prompt_ids + token_ids).endswith(ROCKETS), token_ids
    assert texts == ["🚀"]  # was nothing: the two continuation bytes alone never decode


def test_legacy_top_logprobs_keep_the_taken_tokens_own_figure() -> None:
    """Keyed by text, tokens that read the same (byte pieces of one character: all U+FFFD) took
    each other's place: a later top token overwrote the taken one's logprob."""
    text = {1: "\ufffd", 2: "\ufffd", 3: "的", 4: "\ufffd"}.__getitem__
    entries = [{"token_id": 1, "logprob": -3.0, "top": [(3, -2.5), (2, -2.9), (4, -3.5)]}]
    assert completion_logprobs(entries, text, 0)["top_logprobs"] == [{"\ufffd": -3.0, "的": -2.5}]
    entries = [{"token_id": 3, "logprob": -2.5, "top": [(3, -2.5), (2, -2.9), (4, -3.5)]}]
    assert completion_logprobs(entries, text, 0)["top_logprobs"] == [{"的": -2.5, "\ufffd": -2.9}]


def test_chat_logprob_bytes_join_into_the_text(tokenizer) -> None:
    """OpenAI's logprob `bytes` let a client rebuild a character split over tokens, whose text alone
    is U+FFFD: byte-level BPE pieces (SmolLM2's) and SentencePiece byte fallbacks (Llama 2's)."""
    text = "Grüße 🚀🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    content = chat_logprobs([{"token_id": i, "logprob": -0.5, "top": [(i, -0.5)]} for i in ids], tokenizer)["content"]
    assert any(entry["token"] == "\ufffd" for entry in content)  # the rocket is split
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)

    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "<0x9A>": 3, "<0x80>": 4, "▁a": 5}
    fallback = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    llama2 = Tokenizer(fallback, [], None, None)
    assert [llama2.decode_token(i) for i in (1, 5)] == ["\ufffd", " a"]
    assert b"".join(llama2.token_bytes(i) for i in (5, 1, 2, 3, 4)) == " a🚀".encode()


@pytest.mark.parametrize("decoder", [
    decoders.Metaspace(replacement="▁", prepend_scheme="always"),  # Mistral, newer SentencePiece exports
    decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                       decoders.Strip(" ", 1, 0)]),  # Llama 2's
], ids=["metaspace", "llama2-strip"])
def test_sentencepiece_tokens_keep_their_leading_space(decoder) -> None:
    """Alone, a SentencePiece token's text lost its "▁" space (the decoder strips a text's first):
    logprob tokens and bytes of "Hello world" after a prompt joined into "Helloworld"."""
    hf = HFTokenizer(models.BPE({"<unk>": 0, "▁Say": 1, ":": 2, "▁Hello": 3, "▁world": 4, "▁▁": 5, "▁▁hi": 6}, [],
                                unk_token="<unk>"))
    hf.decoder = decoder
    sp = Tokenizer(hf, [], None, None)
    prompt, output = [1, 2], [3, 4]
    text = sp.decode(prompt + output)[len(sp.decode(prompt)):]  # the output as it is detokenized after its prompt
    assert text == " Hello world"
    assert "".join(sp.decode_token(i) for i in output) == text
    assert b"".join(sp.token_bytes(i) for i in output) == text.encode()
    assert sp.decode_token(2) == ":"  # no "▁", no space
    assert [sp.decode_token(i) for i in (5, 6)] == ["  ", "  hi"]  # an indent's spaces, each of them
    assert sp.decode(prompt + [5, 6])[len(sp.decode(prompt)):] == "    hi"
