"""OpenAI's Responses API (POST /v1/responses, kiln.engine.responses_api) on a real server with
SmolLM2, driven by the openai SDK: the answer is the chat path's for the same conversation
(instructions as the system message, function calls and their outputs as assistant and tool
turns), streamed as the events the SDK's stream helper assembles into the same response, cut by
max_output_tokens as incomplete, with function_call items for tools and JSON for text.format;
and what it cannot take is a 400 naming it."""
from __future__ import annotations

import json

import pytest

from test_server import MODEL, ServerProcess, post

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "1024", "--tool-call-parser", "hermes")
    yield s
    s.stop()


def chat_text(server: ServerProcess, messages: list[dict], max_tokens: int, **extra: object) -> str:
    reply = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, **extra)
    return reply.choices[0].message.content


def test_an_answer_is_the_chat_answer_to_the_same_conversation(server):
    answer = server.client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                            input="What is the capital of France?", max_output_tokens=24,
                                            temperature=0)
    want = chat_text(server, [{"role": "system", "content": "Answer in one short sentence."},
                              {"role": "user", "content": "What is the capital of France?"}], 24)
    assert answer.status == "completed" and answer.output_text == want and "Paris" in want
    assert answer.object == "response" and answer.id.startswith("resp") and answer.model == MODEL
    assert (answer.output[0].type, answer.output[0].role) == ("message", "assistant")
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    # The same conversation again (the API is stateless: each turn resends it) hits the prefix cache.
    again = server.client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                           input="What is the capital of France?", max_output_tokens=24,
                                           temperature=0)
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


def test_text_parts_are_lines_of_one_message_as_vllm_joins_them():
    """List content reaches the template as its parts joined by newlines (vLLM's text-only
    prompt), in chat and as responses input: glued together, words ran into one another."""
    from kiln.engine.openai_protocol import ChatCompletionRequest
    from kiln.engine.responses_api import _messages
    parts = [{"type": "text", "text": "Translate to French:"}, {"type": "text", "text": "Good morning"}]
    chat = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": parts, "name": "ada"}]})
    assert chat.template_messages() == [{"role": "user", "content": "Translate to French:\nGood morning",
                                         "name": "ada"}]
    given = [{**p, "type": "input_text"} for p in parts]
    assert _messages([{"role": "user", "content": given}])[0]["content"] == "Translate to French:\nGood morning"


def test_stream_options_default_and_null_as_vllm_takes_them():
    from kiln.engine.openai_protocol import ChatCompletionRequest
    def options(given: dict):
        return ChatCompletionRequest.model_validate({"model": MODEL, "stream": True, "stream_options": given,
                                                     "messages": [{"role": "user", "content": "hi"}]}).stream_options
    assert options({}).include_usage  # asked for at all: the usage comes
    assert (options({"include_usage": None, "continuous_usage_stats": None}).continuous_usage_stats,
            options({"include_usage": False}).include_usage, options({"include_usage": None}).include_usage) == \
        (False, False, False)  # an explicit null asks for no usage, as vLLM keeps it


def test_a_call_after_the_text_of_its_turn_joins_that_turn():
    """An answer with text and a call comes out as a message item and a function_call item; sent
    back as input they are one assistant turn again, as the model wrote it."""
    from kiln.engine.responses_api import _messages
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    messages = _messages([{"role": "user", "content": "weather?"},
                          {"type": "message", "role": "assistant", "content": [
                              {"type": "output_text", "text": "Let me check."}]},
                          call, {**call, "call_id": "c2"},
                          {"type": "function_call_output", "call_id": "c1", "output": "sunny"}, call])
    assert [(m["role"], m.get("content"), [c["id"] for c in m.get("tool_calls", [])]) for m in messages] == [
        ("user", "weather?", []), ("assistant", "Let me check.", ["c1", "c2"]), ("tool", "sunny", []),
        ("assistant", None, ["c1"])]


def test_empty_tools_and_include_are_taken_as_none(server):
    """The OpenAI Agents SDK sends `"tools": [], "include": []` for every agent without tools."""
    code, reply = post(server.url + "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                      "tools": [], "include": []})
    assert code == 200 and reply["output"][0]["type"] == "message", reply


def test_a_stream_is_assembled_into_the_same_answer(server):
    kwargs = dict(model=MODEL, input="Name three colors.", max_output_tokens=16, temperature=0)
    whole = server.client.responses.create(**kwargs)
    with server.client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"] or kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_max_output_tokens_makes_it_incomplete(server):
    kwargs = dict(model=MODEL, input="Write a long story about a lighthouse.", max_output_tokens=5, temperature=0)
    cut = server.client.responses.create(**kwargs)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == \
        ("incomplete", "max_output_tokens", 5)
    with server.client.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"
    # A named call cut short: its item is incomplete too (it said "completed", its arguments cut).
    cut = server.client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                         tool_choice={"type": "function", "name": "get_weather"},
                                         max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and [(o.type, o.status) for o in cut.output] == [("function_call", "incomplete")]


def test_max_output_tokens_is_echoed_as_sent(server):
    # As OpenAI's: null when unset. It said the budget computed from the context (1024 less the prompt).
    short = {"format": {"type": "json_schema", "name": "pick", "schema": {"enum": ["yes", "no"]}}}
    unset = server.client.responses.create(model=MODEL, input="Yes or no?", temperature=0, text=short)
    assert unset.status == "completed" and unset.max_output_tokens is None, unset
    with server.client.responses.stream(model=MODEL, input="Yes or no?", temperature=0, text=short) as stream:
        told = [e.response.max_output_tokens for e in stream if hasattr(e, "response")]
    assert told and told == [None] * len(told)
    sent = server.client.responses.create(model=MODEL, input="Yes or no?", temperature=0, text=short,
                                          max_output_tokens=7)
    assert sent.max_output_tokens == 7


def test_tools_give_function_calls_whose_outputs_go_back_as_input(server):
    called = server.client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                            tool_choice="required", max_output_tokens=40, temperature=0)
    (call,) = called.output
    assert (call.type, call.name) == ("function_call", "get_weather") and json.loads(call.arguments)["city"]
    with server.client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                        tool_choice={"type": "function", "name": "get_weather"},
                                        max_output_tokens=40, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert [(o.type, json.loads(o.arguments)) for o in streamed.output] == \
        [("function_call", json.loads(call.arguments))]
    # The result goes back as input; the answer is the chat path's to the same turns.
    answer = server.client.responses.create(model=MODEL, max_output_tokens=20, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    want = chat_text(server, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}], 20)
    assert answer.output_text == want and want


def test_text_format_json_schema_gives_json_of_the_schema(server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = server.client.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=60,
                                            temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                            "schema": schema}})
    person = json.loads(answer.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": ""}, "input"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),  # checked on the chat path
    ({"input": "word " * 1100}, "input"),  # past --max-model-len
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input.0.name"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {}}]}, "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "output": "sunny"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": 3}]}, "input.0.output"),
    ({"input": [{"type": "message", "content": "hi"}]}, "input.0.role"),  # was "type not supported"
])
def test_what_it_cannot_take_is_a_400_naming_it(server, body, param):
    code, reply = post(server.url + "/v1/responses", {"model": MODEL, **body})
    assert code == 400 and reply["error"]["param"] == param, reply
    # named as the client sent it, not as the chat request it becomes
    assert not {"max_completion_tokens", "messages"} & set(reply["error"]["message"].replace(":", " ").split()), reply
    code, reply = post(server.url + "/v1/responses", {"model": "nobody", "input": "hi"})
    assert code == 404 and reply["error"]["code"] == "model_not_found"


def test_the_auto_hint_shows_the_responses_shape_of_a_named_choice():
    """Without a parser "auto" is a 400 saying what to send instead: it showed chat's shape."""
    from kiln.engine.api_errors import APIError
    from kiln.engine.responses_api import _in_our_names, chat_request
    from kiln.engine.responses_protocol import ResponsesRequest
    from kiln.engine.tool_calls import tool_calls
    req = ResponsesRequest.model_validate({"input": "hi", "tools": [WEATHER]})
    with pytest.raises(APIError) as caught:
        tool_calls(chat_request(req))
    said = _in_our_names(caught.value)
    assert said.param == "tool_choice" and '{"type": "function", "name": ...}' in said.message
    assert '"function": {' not in said.message
