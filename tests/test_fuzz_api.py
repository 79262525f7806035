"""Fuzzed API (issue 18, item 4): schemathesis generates requests from the OpenAPI documents that
`kiln serve` and `kiln router` publish at /openapi.json, valid ones (positive) and ones that
break the document (negative), and sends them to a real server on SmolLM2 and to a real router
process in front of it. No answer may be a 5xx or fall outside the document: its status code,
content type, headers and body must be documented.

Schemathesis runs as its CLI does (schemathesis.engine), over the document the process serves
(checked equal to the one kiln.engine.openapi / kiln.router.openapi build) with its request
bodies narrowed to this test's server (as_served): the examples, coverage and fuzzing phases,
every operation, every failure collected rather than the first one only."""
from __future__ import annotations

import copy
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from schemathesis.engine import Status
from schemathesis.engine.events import FatalError, NonFatalError, ScenarioFinished

from kiln.engine.openapi import engine_document
from kiln.router.openapi import router_document
from kiln_process import RouterProcess
from test_server import MODEL, ServerProcess, complete, get, post

EXAMPLES = 30  # per operation, in the fuzzing phase alone (the coverage phase adds its own)
MAX_TOKENS = 2  # one prefill step and one decode step: every code path of a generation
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance"]
CONFIG = {
    "seed": 18,  # reproducible: a failure here fails the same way again
    # One operation at a time: Hypothesis parses reprs with ast.parse, and two threads doing so
    # race in CPython 3.11 (SystemError "AST constructor recursion depth mismatch", gh-106905).
    "workers": 1,
    "request-timeout": 120,  # a 128-choice case took over 60 s on a loaded machine
    "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
    "generation": {"mode": "all", "max-examples": EXAMPLES, "database": "none"},
    "phases": {"stateful": {"enabled": False}},  # no links between operations to follow
    "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
}


@pytest.fixture(scope="module")
def engine():
    # A short context (the chat template's default system prompt alone takes 31 tokens) and
    # as_served's budgets keep every fuzzed generation short.
    s = ServerProcess("--max-model-len", "64", "--max-num-seqs", "4", "--kv-cache-memory", "64Mi")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router(engine):
    r = RouterProcess(f"127.0.0.1:{engine.port}")
    yield r
    r.stop()


@dataclass
class Report:
    """What one schemathesis run did: test cases per operation and generation mode, failed
    checks, and errors (of schemathesis or of the transport)."""
    cases: Counter = field(default_factory=Counter)  # (operation, "positive" | "negative") -> count
    statuses: Counter = field(default_factory=Counter)  # (operation, status code) -> count
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def operations(self) -> list[str]:
        return sorted({operation for operation, _ in self.cases})

    def count(self, operation: str, mode: str | None = None) -> int:
        return sum(n for (op, m), n in self.cases.items() if op == operation and mode in (None, m))

    def show(self, name: str) -> None:
        print(f"\n{name}: {sum(self.cases.values())} test cases in {self.seconds:.1f}s, "
              f"{len(self.failures)} failed checks, {len(self.errors)} errors")
        for op in self.operations():
            codes = ", ".join(f"{code}x{n}" for (o, code), n in sorted(self.statuses.items(), key=str) if o == op)
            print(f"  {op:<26} {self.count(op):>4} cases ({self.count(op, 'positive')} positive, "
                  f"{self.count(op, 'negative')} negative); responses {codes}")
        for line in self.failures[:20] + self.errors[:20]:
            print("  " + line)


def as_served(document: dict[str, Any]) -> dict[str, Any]:
    """The document narrowed to this test's server: its one model (any other name is a 404
    before the engine sees the request, so only the served name lets a case reach it) and a
    generation budget of at most MAX_TOKENS, always given (a few tokens run every code path;
    more only take time on two cores), and chat messages with text. Negative cases still break these narrowed rules; the
    responses they are checked against are the served document's, unchanged."""
    narrowed = copy.deepcopy(document)
    # Responses too: its max_output_tokens left open, its 105 valid cases ran to the context's
    # end and took 115 of the run's 150 s.
    for name, required in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                           ("ResponsesRequest", "max_output_tokens")):
        schema = narrowed["components"]["schemas"][name]
        schema["properties"]["model"] = {"const": MODEL}
        for budget in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if budget in schema["properties"]:
                schema["properties"][budget] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
        schema["required"].append(required)
    # A message's content may be null only on an assistant's tool calls, which one schema for
    # every role cannot say: left optional, a whole run's valid chat cases drew it null and all
    # were 400s, and the check that some reach the engine failed by chance.
    message = narrowed["components"]["schemas"]["ChatMessage"]
    message["properties"]["content"] = {"type": "string"}
    message["required"] = ["role", "content"]
    return narrowed


def fuzz(base_url: str, document: dict[str, Any], coverage: bool = True) -> Report:
    """Runs the examples, fuzzing and (with `coverage`) coverage phases; without the coverage
    phase the fuzzing phase asks for 2x EXAMPLES, as Hypothesis stops short of its target
    when it draws the same case again (32 of 100 for completions once `echo` took true too)."""
    status, served = get(base_url + "/openapi.json")
    assert status == 200 and json.loads(served) == document, "not the document the module builds"
    config = schemathesis.Config.from_dict({
        **CONFIG, "base-url": base_url,
        "generation": {**CONFIG["generation"], "max-examples": EXAMPLES * (1 if coverage else 2)},
        "phases": {**CONFIG["phases"], "coverage": {"enabled": coverage}}})
    schema = schemathesis.openapi.from_dict(as_served(document), config=config)
    report = Report()
    started = time.monotonic()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, ScenarioFinished) and event.is_test_scenario:
            _tally(report, event)
        elif isinstance(event, NonFatalError):
            report.errors.append(f"{event.label}: {event.info.message}")
        elif isinstance(event, FatalError):
            report.errors.append(f"fatal: {event.exception!r}")
    report.seconds = time.monotonic() - started
    return report


def _tally(report: Report, event: ScenarioFinished) -> None:
    recorder = event.recorder
    for case_id, node in recorder.cases.items():
        if node.parent_id is not None:  # a request a check derived from another, not generated
            continue
        case = node.value
        report.cases[(recorder.label, case.meta.generation.mode.value if case.meta else "positive")] += 1
        response = recorder.find_response(case_id=case_id)
        report.statuses[(recorder.label, response.status_code if response is not None else "none")] += 1
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status == Status.FAILURE and check.failure_info is not None:
                failure = check.failure_info.failure
                report.failures.append(f"{recorder.label} [{check.name}] {failure.title}: "
                                       f"{failure.message[:300]!r}\n    {check.failure_info.code_sample}")


# Operations with a request body get negative cases too; the rest take no input at all, so
# every request to them is the same one and fuzzing them means calling them.
BODIES = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"}


def _assert_clean(report: Report, document: dict[str, Any], server_log: list[str]) -> None:
    expected = sorted(f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item)
    assert report.operations() == expected
    found = report.errors + report.failures
    assert not found, "\n".join(found) + "\nkiln serve's log ends:\n" + "".join(server_log[-40:])
    for op in BODIES:
        assert report.count(op) >= EXAMPLES, op
        assert report.count(op, "positive") > 0 and report.count(op, "negative") > 0, op
        # The valid share reached the engine: some generated text.
        assert report.statuses[(op, 200)] > 0, op


def test_engine_api_fuzzed(engine):
    report = fuzz(engine.url, engine_document())
    report.show("kiln serve")
    _assert_clean(report, engine_document(), engine.log)


def test_router_api_fuzzed(engine, router):
    # The fuzzing phase alone: the router passes /v1 bodies through unread, so the coverage
    # phase's boundary values would test the engine's validation a second time.
    report = fuzz(router.url, router_document(), coverage=False)
    report.show("kiln router -> kiln serve")
    _assert_clean(report, router_document(), engine.log)


# What fuzzing (and reading its results) found: each was a 5xx or a dead engine before its fix.
FOUND = [
    ("top_k beyond int64 killed the engine", b'{"top_k": 1180591620717411303424}', "top_k"),
    ("seed beyond int64: torch's overflow message", b'{"seed": 1180591620717411303424}', "seed"),
    ("a lone surrogate: 500 from the tokenizer", b'{"prompt": "\\ud800 hi"}', None),
    ("NaN is no JSON number", b'{"temperature": NaN}', None),
    ("Infinity as a penalty", b'{"repetition_penalty": 1e400}', None),  # refused as the body is read
]


@pytest.mark.parametrize("name,fields,param", FOUND, ids=[f[0] for f in FOUND])
def test_what_fuzzing_found_is_a_400(engine, name, fields, param):
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, %s' % (MODEL.encode(), fields[1:])
    status, answer = post(engine.url + "/v1/completions", body)
    print(f"{name}: {status} {answer['error']['message'][:100]}")
    assert status == 400 and answer["error"]["param"] == param
    assert complete(engine, "Hello", max_tokens=2).choices[0].finish_reason == "length"  # alive


# A request's start on each path, without its closing brace.
STARTS = {"/v1/completions": b'{"model": "%s", "prompt": "hi", "max_tokens": 2' % MODEL.encode(),
          "/v1/chat/completions": b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                  b'"max_tokens": 2' % MODEL.encode(),
          "/v1/responses": b'{"model": "%s", "input": "hi", "max_output_tokens": 2' % MODEL.encode()}
# Numbers no double holds, in free-form fields (JSON schemas) that no float field guards.
NOT_DOUBLES = [
    ("/v1/chat/completions", b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
                             b'"schema": {"enum": [1e400, "a"]}}}', "1e400"),
    ("/v1/chat/completions", b'"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", '
                             b'"parameters": {"type": "object", "properties": {"x": {"maximum": -1e400}}}}}]', "-1e400"),
    ("/v1/completions", b'"structured_outputs": {"json": {"enum": [1e400, "a"]}}', "1e400"),
    ("/v1/completions", b'"structured_outputs": {"json": "{\\"enum\\": [1e400, \\"a\\"]}"}', "1e400"),
    ("/v1/responses", b'"text": {"format": {"type": "json_schema", "name": "n", "schema": {"enum": [1e400, "a"]}}}',
     "1e400"),
    ("/v1/responses", b'"tools": [{"type": "function", "name": "f", "parameters": {"enum": [-Infinity]}}]',
     "-Infinity"),
]


@pytest.mark.parametrize("path,fields,number", NOT_DOUBLES, ids=[
    "chat-response_format", "chat-tool-parameters", "structured_outputs", "structured_outputs-as-text",
    "responses-text-format", "responses-tool-parameters"])
def test_a_number_no_double_holds_is_a_400_in_any_field(engine, path, fields, number):
    # json.loads read 1e400 as infinity, which llguidance took as null ({"enum": [1e400, "a"]}
    # let null through) and /v1/responses echoed as Infinity, which is no JSON.
    status, answer = post(engine.url + path, STARTS[path] + b", " + fields + b"}")
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert number in answer["error"]["message"], answer


def test_deeply_nested_json_is_a_400(engine):
    status, answer = post(engine.url + "/v1/completions", b"[" * 100_000)
    assert status == 400, answer  # was a 500: RecursionError in json.loads
    assert "nested too deeply" in answer["error"]["message"]


def test_a_temperature_near_zero_is_greedy(engine):
    greedy = complete(engine, "The capital of France is", max_tokens=6).choices[0].text
    tiny = engine.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                            temperature=1e-300)
    # Was NaN probabilities, and token 0 (<|endoftext|>) drawn every time.
    print(f"greedy {greedy!r}, temperature 1e-300 {tiny.choices[0].text!r}")
    assert tiny.choices[0].text == greedy
