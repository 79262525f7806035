"""Tokenizer: a `tokenizers` Tokenizer plus the chat template (jinja2) and the end-of-sequence
ids, built from a Hugging Face folder or from GGUF metadata."""
from __future__ import annotations

import functools
import json
import os
import re
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kiln.engine.config import ModelLoadError

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> regexes applied in order (as llama.cpp splits), then byte-level mapping
_GGUF_PRE_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then GPT-2 words
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}


# transformers' marker after the final message's text (continue_final_message): where to cut.
FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates trained with assistant-only loss mark
    the assistant's text so): rendered as its body, as transformers renders it for a prompt."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: jinja's escapes HTML, and templates pass json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _render_env() -> ImmutableSandboxedEnvironment:
    # The options and helpers HF chat templates are written against.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def read_chat_template(value: str) -> str:
    """--chat-template, read as vLLM reads it: the text of the file it names, else the template
    itself (a value with a brace or a line break) with its backslash escapes decoded (`\\n` typed
    on a command line is a line break; `\\\\` a backslash); ValueError for a path to no file, a
    malformed escape, or a template that does not compile."""
    path = Path(value)
    if os.path.isfile(path):  # not Path.is_file: a one-line template over 255 bytes raises "name too long"
        try:
            value = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot read it: {e}") from None
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    else:
        value = unescape(value)
    try:
        _render_env().from_string(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e}") from None
    return value


def unescape(text: str) -> str:
    """Python's backslash escapes decoded, every other character kept (beyond Latin-1 too); an
    unknown escape (`\\d` of a regular expression) stays as written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "invalid escape sequence": kept, as said
        try:
            return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as e:
            raise ValueError(f"--chat-template: a backslash escape in it is malformed ({e.reason}); "
                             "write \\\\ for a backslash") from None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it stands for: printable bytes are
    themselves, the others are shifted to 256 and up (Ġ is the space)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(shifted)}


BYTE_OF = _byte_level_alphabet()


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: list[int], bos_token_id: int | None,
                 chat_template: str | None, template_source: str | Path = "the model",
                 tool_use_template: str | None = None) -> None:
        """template_source: the file the chat template came from, named when it does not compile;
        tool_use_template: the model's template for requests with tools, where it has its own."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template, self.tool_use_template = chat_template, tool_use_template
        if not all(t is None or isinstance(t, str) for t in (chat_template, tool_use_template)):
            raise ModelLoadError(f"{template_source}: the chat template is not text")
        try:
            self._template = _render_env().from_string(chat_template) if chat_template else None
            self._tool_template = _render_env().from_string(tool_use_template) if tool_use_template else None
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"{template_source}: the chat template does not compile: {e}") from None
        # The most characters of text one token can stand for: its vocabulary entry's length, which
        # byte-level (`Ġ`, `Ã©`) and metaspace (`▁`) entries and byte fallbacks (`<0x0A>`) only
        # overstate. Here, not on the first request: it walks the whole vocabulary.
        self.most_chars_per_token = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
        # One token's text with special tokens written out, as logprobs report it. Cached: logprob
        # responses decode the same few thousand tokens over and over.
        self.decode_token = functools.lru_cache(maxsize=65536)(self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        # SentencePiece decoders (Metaspace, Llama 2's Strip) drop a text's first space, so each
        # "▁word" (or "▁▁" of an indent) alone lost one: the tokens' texts and bytes no longer
        # joined into the output. Its piece's leading "▁"s say how many spaces it stands for.
        piece = self.tokenizer.id_to_token(token_id) or ""
        missing = (len(piece) - len(piece.lstrip("▁"))) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprob `bytes`): where it holds part of a UTF-8
        character its text alone is U+FFFD, and only its bytes let a client join the character."""
        text = self.decode_token(token_id)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.id_to_token(token_id) or ""
        if fallback := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):  # SentencePiece's byte fallback
            return bytes([int(fallback[1], 16)])
        if piece and all(c in BYTE_OF for c in piece):  # a byte-level BPE piece
            return bytes(BYTE_OF[c] for c in piece)
        return text.encode()

    def with_chat_template(self, template: str, source: str = "--chat-template") -> Tokenizer:
        """This tokenizer with another chat template (the model's may be missing or unwanted)."""
        return Tokenizer(self.tokenizer, self.eos_token_ids, self.bos_token_id, template, source)  # tools too

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_letting_threads_run(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode, through the library call that releases the GIL (encode_batch: encode holds it
        throughout), for a thread beside the event loop."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(token_id) or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            **kwargs: Any) -> str:
        """The conversation as the model's template writes it (as transformers renders it). With
        continue_final_message, cut just after the final message's text: the model continues it.
        ValueError when the model has no template or it cannot continue that message."""
        template = self._tool_template if tools is not None and self._tool_template else self._template
        if template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if continue_final_message:  # tagged: its text may also occur in the end-of-turn marker ("<")
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ValueError("continue_final_message: the final message has no text to continue")
            messages = [*messages[:-1], {**messages[-1], "content": final + FINAL_MESSAGE_TAG}]
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               bos_token=self.token_text(self.bos_token_id), eos_token=self.token_text(eos), **kwargs)
        if not continue_final_message:
            return text
        at = text.rfind(FINAL_MESSAGE_TAG.strip())
        if at < 0:
            raise ValueError("continue_final_message: the chat template leaves out the final message's text, "
                             "so there is nothing to continue")
        # where the template strips the text, its trailing spaces went too
        return text[:at] if text.startswith(FINAL_MESSAGE_TAG, at) else text[:at].rstrip()


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas. Text is released only once the bytes
    decode cleanly, so a multi-byte UTF-8 character split across tokens is never cut; flush()
    releases what is left at the end (a character the model never finished, as U+FFFD).

    Seeded with the prompt's last tokens (as vLLM does), a character whose first bytes end the
    prompt is emitted whole by the output token that completes it."""

    PROMPT_TAIL = 4  # a UTF-8 character is at most 4 bytes: at most 3 of them end the prompt

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list((prompt_ids or [])[-self.PROMPT_TAIL:])
        self.text = ""
        self._prefix_offset = 0  # decode window start: earlier tokens never affect the delta
        self._read_offset = len(self.ids)  # ids up to here are already in self.text (or the prompt)
        # Where the released text ends within the window's decoding. Only a prompt tail can end in
        # a partial character (its U+FFFD is not released; the character comes out whole later).
        self._prompt_text: str | None = self._decode(self.ids)
        self._released = len(self._prompt_text.rstrip("\ufffd"))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) <= self._released or full.endswith("\ufffd"):
            return ""  # nothing new, or an incomplete UTF-8 sequence: wait for more bytes
        return self._release(full)

    def flush(self) -> str:
        """At the end: whatever is still held back (an unfinished character decodes as U+FFFD)."""
        full = self._decode(self.ids[self._prefix_offset:])
        return self._release(full) if len(full) > self._released else ""

    def _release(self, full: str) -> str:
        start = self._released
        if self._prompt_text is not None:  # the first release: was the prompt's U+FFFD a character begun?
            if full.startswith(self._prompt_text):  # no: a real U+FFFD, or bytes the output never finished
                start = len(self._prompt_text)
            self._prompt_text = None
        delta = full[start:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._released = len(self._decode(self.ids[self._prefix_offset:]))
        self.text += delta
        return delta


def load_hf_tokenizer(folder: Path, eos_token_ids: list[int], bos_token_id: int | None) -> Tokenizer:
    """tokenizer.json + the chat template (chat_template.jinja, else tokenizer_config.json)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (Kiln reads fast tokenizers only)")
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ModelLoadError(f"{path}: cannot read tokenizer: {e}") from None
    template = None
    config_path = folder / "tokenizer_config.json"
    try:
        tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: the message alone named no file
        raise ModelLoadError(f"{config_path}: invalid JSON: {e}") from None
    if not isinstance(tok_config, dict):
        raise ModelLoadError(f"{config_path}: not a JSON object")
    template_path, tool_use = config_path, None
    named = tok_config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template_path = folder / "chat_template.jinja"
        template = _read_text(template_path)
        if (folder / "additional_chat_templates" / "tool_use.jinja").is_file():  # transformers' folder of named ones
            tool_use = _read_text(folder / "additional_chat_templates" / "tool_use.jinja")
    elif isinstance(named, list):  # named templates, as transformers picks them: tool_use for tools
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in named):
            raise ModelLoadError(f"{config_path}: chat_template must be a string or a list of "
                                 '{"name": ..., "template": ...}')
        by_name = {t["name"]: t["template"] for t in named}
        template, tool_use = by_name.get("default"), by_name.get("tool_use")
    else:
        template = named
    if tok_config.get("eos_token"):
        eos = tok_config["eos_token"]
        eos = eos.get("content") if isinstance(eos, dict) else eos  # transformers' AddedToken, or the text
        if not isinstance(eos, str):  # a KeyError or TypeError from deep in the start-up, naming no file
            raise ModelLoadError(f"{config_path}: eos_token must be the token's text (or {{\"content\": text}}), "
                                 f"got {tok_config['eos_token']!r}")
        eos_id = tokenizer.token_to_id(eos)
        # transformers' tokenizer.eos_token: first, as templates write it as eos_token, and a stop
        # token beside config.json's (vLLM's too): a fine-tune that set only this one (ChatML's
        # <|im_end|> over the base's <|endoftext|>) ran every answer to max_tokens.
        if eos_id is not None:
            eos_token_ids = [eos_id, *(i for i in eos_token_ids if i != eos_id)]
    return Tokenizer(tokenizer, eos_token_ids, bos_token_id, template, template_path, tool_use)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # the message alone named no file
        raise ModelLoadError(f"{path}: not UTF-8 text: {e}") from None


def build_gguf_tokenizer(metadata: dict[str, Any], source: str) -> HFTokenizer:
    """A byte-level BPE `tokenizers` Tokenizer from tokenizer.ggml.* metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{source}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE "
                             f"'gpt2'); load the model from a Hugging Face folder instead")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_SPLITS:
        raise ModelLoadError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported "
                             f"(supported: {sorted(_GGUF_PRE_SPLITS)})")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{source}: GGUF metadata tokenizer.ggml.tokens must be a list of strings")
    merges = metadata.get("tokenizer.ggml.merges", [])
    if not all(isinstance(m, str) and " " in m for m in merges):
        raise ModelLoadError(f"{source}: GGUF metadata tokenizer.ggml.merges must be strings 'left right'")
    merges = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3's tokenizer (and llama.cpp reading its GGUF) takes a word that is in the vocabulary
    # whole before trying merges, and starts a prompt with BOS unless the metadata says not to.
    llama3 = pre in ("llama-bpe", "llama3")
    try:
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, ignore_merges=llama3)
    except Exception as e:  # the tokenizers library raises plain Exceptions (a merge of an unknown token)
        raise ModelLoadError(f"{source}: GGUF metadata tokenizer.ggml.merges: {e}") from None
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _GGUF_PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or []
    if not isinstance(types, list) or len(types) > len(tokens):
        raise ModelLoadError(f"{source}: GGUF metadata tokenizer.ggml.token_type must be a list, one entry per "
                             f"token ({len(tokens)})")
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _USER_DEFINED])
    specials = [(name, metadata.get(f"tokenizer.ggml.{name}_token_id")) for name in ("bos", "eos")]
    for name, i in specials:
        if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens)):
            raise ModelLoadError(f"{source}: GGUF metadata tokenizer.ggml.{name}_token_id {i!r} is not a token id "
                                 f"(the vocabulary has {len(tokens)})")
    added = {name: tokens[i] for name, i in specials
             if i is not None and metadata.get(f"tokenizer.ggml.add_{name}_token", llama3 and name == "bos")}
    if added:
        # By which flag says so, not by id: a model whose BOS is its EOS adds it once, at the start.
        bos = [f"{added['bos']}:0"] if "bos" in added else []
        eos = [f"{added['eos']}:0"] if "eos" in added else []
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(bos + ["$A:0"] + eos), pair=" ".join(bos + ["$A:0"] + eos + bos + ["$B:1"] + eos),
            special_tokens=sorted({(added[name], i) for name, i in specials if name in added}))
    return tokenizer
