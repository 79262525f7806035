"""tool_choice "auto" with `kiln serve --tool-call-parser hermes`: the Hermes-format parser on its
own (calls, content before them, streamed content held back at a tag split across chunks), and a
real server on SmolLM2, which copies the call format from earlier turns of the conversation."""
from __future__ import annotations

import json
import logging
import re
from typing import Literal

import llguidance
import openai
import pytest
from pydantic import BaseModel, Field

from kiln.cli import main as cli_main
from kiln.engine import openapi
from kiln.engine.api_errors import APIError
from kiln.engine.openai_protocol import ChatCompletionRequest
from kiln.engine.openai_serving import ChatShape
from kiln.engine.structured_output import to_grammar
from kiln.engine.tool_calls import NO_PARAMETERS, tool_calls
from kiln.engine.tool_parsers import PARSERS
from test_server import CLOCK, MODEL, WEATHER, ServerProcess, post

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius"}}\n</tool_call>'
TOOLS = [WEATHER]


HERMES, LLAMA, MISTRAL, PYTHONIC = (PARSERS[name] for name in ("hermes", "llama3_json", "mistral", "pythonic"))
OSLO = ("get_weather", '{"city": "Oslo", "unit": "celsius"}')


@pytest.mark.parametrize("parser,text,parsed", [
    (HERMES, "Let me look. " + CALL % "Oslo" + '\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
     ("Let me look. ", [OSLO, ("get_time", "{}")])),
    (HERMES, '<tool_call>{"name": "f", "arguments": {}}', (None, [("f", "{}")])),  # end tag cut by max_tokens
    (LLAMA, ' {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', (" ", [OSLO])),
    (LLAMA, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     (None, [("f", '{"a": 1}'), ("g", "{}")])),
    (MISTRAL, 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
     ("Sure.", [OSLO])),
    (MISTRAL, 'One sec.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "celsius"}'
              '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}', ("One sec.", [OSLO, ("get_time", "{}")])),
    (PYTHONIC, '[get_weather(city="Oslo", unit=\'celsius\'), get_time()]', (None, [OSLO, ("get_time", "{}")])),
    (PYTHONIC, '<|python_start|>[f(a=[1, 2.5], b={"k": None}, c=True)]<|python_end|>',
     (None, [("f", '{"a": [1, 2.5], "b": {"k": null}, "c": true}')])),
    (HERMES, '<tool_call>{"name": "f", "arguments": null}</tool_call>', (None, [("f", "{}")])),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Z\\u00fcrich\\"}"}</tool_call>',
     (None, [("f", '{"city": "Zürich"}')])),  # a JSON string of the object; the text as written
    # Either key, whatever the template shows: "parameters" in a hermes block ran with no arguments.
    (HERMES, '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}</tool_call>',
     (None, [OSLO])),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]', (None, [OSLO])),
    (LLAMA, '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}', (None, [OSLO])),
])
def test_each_parser_reads_its_calls_and_the_text_before_them(parser, text, parsed) -> None:
    assert parser.parse(text) == parsed


@pytest.mark.parametrize("parser,text", [
    (HERMES, "plain text"), (HERMES, '<tool_call>{"name": "f", "argu'), (HERMES, '<tool_call>{"arguments": {}}'),
    (HERMES, "<tool_call>[1]</tool_call>"), (HERMES, '<tool_call>{"name": 3}</tool_call>'),
    (LLAMA, 'The call is {"name": "f", "parameters": {}}'),  # not the whole answer: text
    (LLAMA, '{"name": "f", "parameters": {}} and more'), (LLAMA, '{"name": "f", "parameters": {}};'),
    (LLAMA, "{not json}"), (LLAMA, '{"name": "Ada Lovelace", "born": 1815}'), (MISTRAL, "[TOOL_CALLS] [{\"name\": \"f\""), (MISTRAL, "no calls"),
    (MISTRAL, "[TOOL_CALLS]get weather[ARGS]{}"), (MISTRAL, '[TOOL_CALLS]f[ARGS]{"a": '),
    (MISTRAL, "[TOOL_CALLS]f[ARGS]{} trailing words"),
    (PYTHONIC, "[f(x=1)] and then text"), (PYTHONIC, "[f(1)]"), (PYTHONIC, "[f(x=open('/etc/passwd'))]"),
    (PYTHONIC, "[os.system(x='ls')]"), (PYTHONIC, "[f(**kw)]"), (PYTHONIC, "[f(x={1, 2})]"), (PYTHONIC, "[1, 2]"),
    (PYTHONIC, "[f(x=" + "[" * 5000 + "]" * 5000 + ")]"),
    # Arguments a client could not json.loads into an object: not a call either.
    (HERMES, '<tool_call>{"name": "f", "arguments": "city=Oslo"}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Os"}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    (LLAMA, '{"name": "f", "parameters": {"x": Infinity}}'), (PYTHONIC, "[f(x=1e999)]"), (PYTHONIC, "[f(x=b'ab')]"),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": "oops"}]'),
    # Not valid Unicode (a lone surrogate written as an escape): a Responses stream broke on it.
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": "\\ud83d"}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f\\udc00", "arguments": {}}</tool_call>'), (PYTHONIC, '[f(x="\\ud83d")]'),
    # Nested past CPython's parser stack: MemoryError, not SyntaxError, escaped as a 500.
    (PYTHONIC, "[" + "-" * 12000), (PYTHONIC, "[x" + "+" * 12000 + "1]"),
    # No call at all: content (it was a "tool_calls" finish with no calls, the text lost).
    (PYTHONIC, "[]"), (MISTRAL, "[TOOL_CALLS][]"), (LLAMA, "<|python_tag|>"),
])
def test_output_that_makes_no_whole_call_is_not_parsed(parser, text) -> None:
    assert parser.parse(text) is None


@pytest.mark.parametrize("name,text,content,calls", [
    ("hermes", "Sure, one moment. " + CALL % "Oslo", "Sure, one moment. ", ["Oslo"]),
    ("hermes", "No call here, only a < sign and <tool", "No call here, only a < sign and <tool", []),
    ("hermes", CALL % "Oslo" + CALL % "Lima", None, ["Oslo", "Lima"]),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}}', None, ["Lima"]),
    ("llama3_json", "Lima is in Peru; it rarely rains there.", "Lima is in Peru; it rarely rains there.", []),
    ("pythonic", '[get_weather(city="Lima"), get_weather(city="Oslo")]', None, ["Lima", "Oslo"]),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    ("mistral", 'Hm [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Hm ", ["Oslo"]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
     None, ["Lima", "Oslo"]),
])
@pytest.mark.parametrize("size", [1, 3, 11])
def test_a_stream_sends_the_same_content_and_calls_as_the_whole_answer(name, text, content, calls, size) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    tools = tool_calls(req, name)
    whole = ChatShape(None, False, 0, tools).full(text, [], "stop")
    assert whole["message"]["content"] == content
    assert [json.loads(c["function"]["arguments"])["city"] for c in whole["message"].get("tool_calls", [])] == calls
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    shape, chunks = ChatShape(None, False, 0, tools), [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [shape.delta(chunk, [], "stop" if i == len(chunks) - 1 else None) for i, chunk in enumerate(chunks)]
    streamed = "".join(d["delta"].get("content", "") for d in deltas)
    assert streamed == (content or "")
    if calls:  # nothing of a call went out as text
        assert not any(opening in d["delta"].get("content", "") for d in deltas for opening in tools.parser.opens)
    assert [c["function"] for d in deltas for c in d["delta"].get("tool_calls", [])] == \
        [c["function"] for c in whole["message"].get("tool_calls", [])]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"]


def few_shot(question: str) -> list[dict]:
    """Two earlier turns in which the assistant answered a weather question with a call."""
    return [{"role": "system", "content": "For weather questions call get_weather, writing " + CALL % "CITY"},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": CALL % "Paris"},
            {"role": "user", "content": "What is the weather in Berlin?"},
            {"role": "assistant", "content": CALL % "Berlin"},
            {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "512", "--kv-cache-memory", "64Mi", "--tool-call-parser", "hermes",
                      "--enable-auto-tool-choice")
    yield s
    s.stop()


def test_auto_answers_a_call_the_model_writes_as_tool_calls(server) -> None:
    ask = dict(model=MODEL, messages=few_shot("What is the weather in Tokyo?"), tools=TOOLS, max_tokens=60,
               temperature=0)
    choice = server.client.chat.completions.create(**ask).choices[0]  # tool_choice left out: "auto"
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"]
    chunks = list(server.client.chat.completions.create(**ask, tool_choice="auto", stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # nothing of the call leaks as text
    (streamed,) = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    assert streamed.index == 0 and streamed.function.model_dump() == call.function.model_dump()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_answers_text_the_model_writes_as_content(server) -> None:
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Write one sentence about cats."}], tools=TOOLS,
               max_tokens=24, temperature=0)
    choice = server.client.chat.completions.create(**ask).choices[0]
    plain = server.client.chat.completions.create(**{**ask, "tools": None}).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == plain.finish_reason
    assert "<tool_call>" not in plain.message.content  # else this checks nothing about content
    chunks = list(server.client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_a_parser_must_be_known_and_auto_needs_one(caplog, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--tool-call-parser", "no_such_parser"])
    assert exc.value.code == 2 and "invalid choice: 'no_such_parser'" in capsys.readouterr().err
    with caplog.at_level(logging.ERROR):
        assert cli_main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in caplog.text


class _Place(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class _Forecast(BaseModel):
    place: _Place
    unit: Literal["celsius", "fahrenheit"]


def test_required_takes_tools_whose_schemas_use_defs(server) -> None:
    # openai.pydantic_function_tool writes a nested model as "$defs" and "$ref": "#/$defs/_Place";
    # under "required"'s array of calls that pointer missed (400 "Pointer '/$defs/_Place' does not exist").
    tool = openai.pydantic_function_tool(_Forecast)
    assert "$defs" in tool["function"]["parameters"]  # else this checks nothing
    for parallel in (False, True):
        choice = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the forecast for Oslo, Norway?"}],
            tools=[tool, CLOCK], tool_choice="required", parallel_tool_calls=parallel, max_tokens=120,
            temperature=0).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        forecasts = [c.function.arguments for c in choice.message.tool_calls if c.function.name == "_Forecast"]
        assert forecasts and all(_Forecast.model_validate_json(arguments) for arguments in forecasts)


def test_an_answer_goes_back_as_the_sdk_dumps_it(server) -> None:
    # message.model_dump() has "refusal", "audio", "function_call" and "annotations" as null: was a
    # 400 "unsupported parameter: messages.1.refusal" (OpenAI and vLLM take it).
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    called = server.client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, max_tokens=80,
                                                   temperature=0).choices[0].message
    sent = called.model_dump()
    assert sent["refusal"] is None and sent["content"] is None  # else this checks nothing
    answer = server.client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="none", max_tokens=8,
                                                   temperature=0, messages=ask + [sent, {
        "role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "12 C and rain"}]).choices[0]
    assert answer.message.content


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_sdk_stream_helper_reports_each_call_done(server, tool_choice) -> None:
    # The calls and the finish_reason came in one chunk, where OpenAI sends the finish after: the
    # SDK's helper then never fired tool_calls.function.arguments.done for the last call.
    with server.client.beta.chat.completions.stream(
            model=MODEL, messages=few_shot("What is the weather in Tokyo?"), tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=60, temperature=0) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    (call,) = final.message.tool_calls
    assert [(e.index, e.name, e.arguments) for e in done] == [(0, "get_weather", call.function.arguments)]
    assert json.loads(call.function.arguments)["city"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_a_function_without_parameters_is_called_with_none(server, tool_choice) -> None:
    # OpenAI: left out, parameters are "an empty parameter list". Any object was allowed, and SmolLM2
    # wrote keys until max_tokens cut the call short: content, no call.
    choice = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the server up?"}], max_tokens=40, temperature=0,
        tools=[{"type": "function", "function": {"name": "ping", "description": "Check the server"}}],
        tool_choice=tool_choice).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}


@pytest.mark.parametrize("tools,message", [
    ([WEATHER, CLOCK, WEATHER], "tools name the function 'get_weather' twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     r'tools\[0\].function.parameters: a function\'s parameters are a JSON schema of type "object"'),
])
def test_tools_that_cannot_be_called_as_sent_are_a_400(tools, message) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                "tool_choice": "required"})
    with pytest.raises(APIError, match=message) as e:
        tool_calls(req)
    assert e.value.status == 400 and e.value.param.startswith("tools")


def request(parameters: dict, tool_choice: object = "required") -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 "tool_choice": tool_choice})


@pytest.mark.parametrize("parameters,none", [
    ({}, True), ({"properties": {"a": {"type": "integer"}}}, False),
    # No properties, as MCP and LangChain write a function of none: any object, and the call was lost.
    ({"type": "object", "properties": {}}, True), ({"type": "object", "properties": {}, "required": []}, True),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, False),
])
def test_arguments_are_always_an_object(parameters, none) -> None:
    # {} is no parameters, as when left out; a schema without a type still takes only objects
    # (a bare {} let a named call's "arguments" be "hello" or [1]).
    schema = tool_calls(request(parameters, {"type": "function", "function": {"name": "f"}})).structured_outputs().json
    assert schema["type"] == "object" and (schema == NO_PARAMETERS) == none


def test_a_schema_with_its_own_id_compiles_under_required() -> None:
    """Moved under the array's $defs, its local refs were resolved against its $id and missed
    (400 "Pointer '/$defs/tool0/$defs/A' does not exist"); named calls took it."""
    parameters = {"$id": "https://example.com/f", "type": "object", "$defs": {"A": {"type": "integer"}},
                  "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}
    assert llguidance.LLMatcher.validate_grammar(to_grammar(tool_calls(request(parameters)).structured_outputs())) == ""


def test_required_arguments_beyond_float_are_content_not_infinity() -> None:
    """The grammar takes 1e400; read back and written again it was "Infinity", which no client parses."""
    calls = tool_calls(request({"type": "object", "properties": {"x": {"type": "number"}}}))
    assert calls.message('[{"name": "f", "parameters": {"x": 1e400}}]', "stop") == \
        ({"content": '[{"name": "f", "parameters": {"x": 1e400}}]'}, "stop")
    assert calls.message('[{"name": "f", "parameters": {"x": 1e30}}]', "stop")[1] == "tool_calls"


@pytest.mark.timeout(60)  # linear: well under a second; quadratic: about 16 minutes
def test_a_mistral_call_name_followed_by_a_run_of_whitespace_fails_fast() -> None:
    """A model looping on spaces after a call's name: the pattern backtracked quadratically, 65 s
    on the event loop (every stream and /health stalled) for 128k spaces; 512k here."""
    assert MISTRAL.parse("[TOOL_CALLS]get_weather" + " " * 524288 + "x") is None
    assert MISTRAL.parse("a [CALL_ID] b" + " " * 524288 + "x") is None


def test_required_arguments_that_are_not_unicode_are_content() -> None:
    calls = tool_calls(request({"type": "object", "properties": {"x": {"type": "string"}}}))
    text = '[{"name": "f", "parameters": {"x": "\\ud83d"}}]'
    assert calls.message(text, "stop") == ({"content": text}, "stop")


def test_output_nested_past_the_json_parsers_depth_is_content_not_a_500() -> None:
    """A tool whose parameters take any value, and a model looping on "[": json.loads raised
    RecursionError, which escaped as a 500 (or broke a stream after its headers)."""
    calls = tool_calls(request({"type": "object", "properties": {"x": {}}}))
    deep = '[{"name": "f", "parameters": {"x": ' + "[" * 5000 + "]" * 5000 + "}}]"
    assert calls.message(deep, "length") == ({"content": deep}, "length")


def test_a_past_calls_arguments_nested_past_the_parsers_depth_stay_a_string() -> None:
    """Made an object for the template, they raised RecursionError: a 10 KB request got a 500."""
    arguments = "[" * 5000 + "]" * 5000
    body = {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    messages = ChatCompletionRequest.model_validate(body).template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == arguments


def test_a_call_answer_follows_the_served_document(server) -> None:
    """/openapi.json said content is a string and finish_reason "stop" or "length": a client
    generated from it rejected every answer that made a call."""
    code, answer = post(server.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
        "tool_choice": "required", "max_tokens": 60, "temperature": 0})
    assert code == 200 and answer["choices"][0]["finish_reason"] == "tool_calls", answer
    openapi.ChatCompletion.model_validate(answer)


def test_with_a_parser_special_tokens_stay_in_the_text_it_reads(server) -> None:
    """A call's opening may be a special token (Mistral's [TOOL_CALLS]): decoded away, the parser
    never saw it. Forced with logit_bias here, SmolLM2's <|im_start|> stays with tools and "auto"."""
    special = post(server.url + "/tokenize", {"prompt": "<|im_start|>", "add_special_tokens": False})[1]["tokens"]
    assert len(special) == 1  # one special token, else this checks nothing
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
               logit_bias={str(special[0]): 100})
    assert server.client.chat.completions.create(**ask).choices[0].message.content == ""
    kept = server.client.chat.completions.create(**ask, tools=TOOLS).choices[0].message.content
    assert kept == "<|im_start|>" * 2


def test_mistral_call_ids_are_what_its_templates_take() -> None:
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "tools": TOOLS, "tool_choice": "required"})
    written = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    for parser, pattern in (("mistral", r"[0-9a-zA-Z]{9}"), ("hermes", r"call_[0-9a-f]{24}"),
                            (None, r"call_[0-9a-f]{24}")):
        message, _ = tool_calls(req, parser).message(written, "stop")
        assert re.fullmatch(pattern, message["tool_calls"][0]["id"]), (parser, message)
