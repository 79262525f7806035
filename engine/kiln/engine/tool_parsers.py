"""How models write tool calls in their text, for tool_choice "auto" (`kiln serve
--tool-call-parser NAME`, vLLM's names):

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block a call, after
               any text (Qwen2.5, Hermes, and any model whose chat template teaches it)
  llama3_json  {"name": ..., "parameters": {...}} as the whole answer, calls separated by ";",
               optionally after <|python_tag|> (Llama 3.1-3.3's JSON tool calling)
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] after any text (Mistral 7B
               v0.3, Nemo); or, from the v11 tokenizer on (Mistral Small 3.1+, Devstral), one
               [TOOL_CALLS]name[ARGS]{...} a call, optionally with [CALL_ID]id before [ARGS]
  pythonic     [get_weather(city="Oslo"), get_time()] as the whole answer, literal keyword
               arguments only, optionally inside <|python_start|>...<|python_end|> (Llama 3.2, Llama 4)

A parser answers (content before the calls or None, [(name, arguments JSON)]), or None where the
output makes no call or its calls do not parse: then the whole output is content, so nothing
the model wrote is lost."""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

Calls = list[tuple[str, str]]


def _call(obj: object) -> tuple[str, str]:
    """(name, arguments as a JSON string) of one parsed call; ValueError if it is not one.
    Models write "arguments" or "parameters" whatever their template shows: either is read (a
    hermes call with "parameters" was run with no arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):  # some models write the object as a JSON string
        arguments = json.loads(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError("arguments are not an object")
    return unicode(obj["name"]), arguments_json(arguments)


def arguments_json(arguments: object) -> str:
    """A call's arguments as a client reads them (json.loads / JSON.parse): strict JSON (no NaN),
    the text as written; ValueError if they are not valid Unicode."""
    return unicode(json.dumps(arguments, ensure_ascii=False, allow_nan=False))


def unicode(text: str) -> str:
    """text, or ValueError (UnicodeEncodeError) where it holds a lone surrogate: a model writing
    "\ud83d" in its JSON made one, which broke a Responses stream mid-way and strict JSON clients."""
    text.encode()
    return text


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(calls_text: str) -> Calls:
    # A last block that max_tokens cut before its end tag still counts when its JSON is whole.
    return [_call(json.loads(block)) for block in _HERMES_BLOCK.findall(calls_text)]


def _llama3_json(calls_text: str) -> Calls:
    text, decoder, calls, position = calls_text.removeprefix("<|python_tag|>"), json.JSONDecoder(), [], 0
    while True:
        position += len(text[position:]) - len(text[position:].lstrip())  # raw_decode takes no leading space
        obj, position = decoder.raw_decode(text, position)
        # Nothing but this shape marks a call: an answer that is a JSON object with a "name" (a
        # person's, say) is content, as in vLLM, unless it carries the call's parameters too.
        if isinstance(obj, dict) and not {"parameters", "arguments"} & obj.keys():
            raise ValueError("no parameters: an answer in JSON, not a call")
        calls.append(_call(obj))
        rest = text[position:].strip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            raise ValueError("calls must be separated by ';'")
        position = text.index(";", position) + 1


# No two \s* side by side: a call's name followed by a run of whitespace (a model looping on
# newlines) backtracked quadratically, 65 s on the event loop for 128k spaces.
_MISTRAL_V11_CALL = re.compile(r"\s*([\w.-]+)(?:\s*\[CALL_ID\]\s*\w+)?\s*(?:\[ARGS\]\s*)?(\{.*\})\s*", re.DOTALL)


def _mistral(calls_text: str) -> Calls:
    text = calls_text.removeprefix("[TOOL_CALLS]")
    if text.lstrip().startswith(("[", "{")):
        calls = json.loads(text)
        return [_call(c) for c in (calls if isinstance(calls, list) else [calls])]
    calls = []
    for segment in text.split("[TOOL_CALLS]"):
        match = _MISTRAL_V11_CALL.fullmatch(segment)
        if match is None:
            raise ValueError("not name[ARGS]{...}")
        calls.append(_call({"name": match[1], "arguments": json.loads(match[2])}))
    return calls


def _pythonic(calls_text: str) -> Calls:
    text = calls_text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, MemoryError) as e:  # MemoryError: nested past the parser's stack ("[" + "-" * 12000)
        raise ValueError("not a Python list") from e
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("each call is name(keyword=literal, ...)")
        # literal_eval: a value is read, never run
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(arguments) != len(node.keywords):
            raise ValueError("**kwargs is not a literal argument")
        calls.append(_call({"name": node.func.id, "arguments": arguments}))
    return calls


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's chat templates refuse a call id that is not 9 letters or digits."""
    return uuid.uuid4().hex[:9]


@dataclass(frozen=True)
class ToolParser:
    opens: tuple[str, ...]  # what starts the calls
    anywhere: bool  # the calls may follow text (else they are the whole answer)
    read: Callable[[str], Calls]  # the calls of the text from its opening on; raises if they do not parse
    call_id: Callable[[], str] = openai_call_id  # the ids given to calls, as the model's template takes them

    def start(self, text: str) -> int | None:
        """Where the calls begin in text, or None."""
        if self.anywhere:
            found = [i for i in (text.find(o) for o in self.opens) if i >= 0]
            return min(found) if found else None
        lead = len(text) - len(text.lstrip())
        return lead if text.startswith(self.opens, lead) else None

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        start = self.start(text)
        if start is None:
            return None
        try:
            calls = self.read(text[start:])
        except (ValueError, TypeError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            return None
        # No call at all ("[]"): the answer is content, or it was lost under a "tool_calls" finish.
        return ((text[:start] or None), calls) if calls else None

    def streamable(self, text: str) -> int:
        """How much of text, from the start, a stream may send as content now: up to the calls,
        less a tail that may be an opening's beginning (or none of it while the answer may still
        open with calls)."""
        start = self.start(text)
        if start is not None:
            return start
        if not self.anywhere:
            lead = text.lstrip()
            return 0 if any(o.startswith(lead) for o in self.opens) else len(text)
        tail = max((n for o in self.opens for n in range(1, min(len(o), len(text) + 1))
                    if o.startswith(text[-n:])), default=0)
        return len(text) - tail


PARSERS = {"hermes": ToolParser(("<tool_call>",), True, _hermes),
           "llama3_json": ToolParser(("<|python_tag|>", "{"), False, _llama3_json),
           "mistral": ToolParser(("[TOOL_CALLS]",), True, _mistral, mistral_call_id),
           "pythonic": ToolParser(("<|python_start|>", "["), False, _pythonic)}
