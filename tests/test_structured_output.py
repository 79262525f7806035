"""Structured outputs on the real SmolLM2 (float32): JSON schemas (checked with the jsonschema
validator), regexes, choices and Lark grammars, greedy and sampled, in batches with unconstrained
requests and with n-gram speculation on (drafts masked as the matcher stands after the drafts
before them: the same tokens as without); greedy choices checked token by token against the
model's own ranking of what a fresh llguidance matcher allows; bad constraints refused."""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest

from kiln.engine import LLM, SamplingParams
from kiln.engine.sampling_params import StructuredOutputs
from kiln.engine.structured_output import allowed_tokens, to_grammar
from kiln.engine.speculative import SpeculativeConfig
from test_engine_generate import one_thread  # noqa: F401 (autouse: one torch thread, as there)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person who speaks some languages, as JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Speculation on: constrained requests draft too, within what their constraint allows.
    return LLM(dtype="float32", speculative=SpeculativeConfig(num_speculative_tokens=3))


def constrained(kind: str, value, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 80), structured_outputs=StructuredOutputs(**{kind: value}),
                          **kw)


@pytest.mark.parametrize("whitespace", [True, False], ids=["any-whitespace", "compact"])
def test_json_schema_outputs_validate_greedy_and_sampled(llm, whitespace):
    params = [SamplingParams(temperature=t, seed=s, max_tokens=120, structured_outputs=StructuredOutputs(
        json=PERSON, disable_any_whitespace=not whitespace)) for t, s in [(0.0, None), (1.0, 1), (1.0, 2), (0.8, 3)]]
    outs = llm.chat([ASK] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop", out  # the object closed: nothing could follow
        jsonschema.validate(json.loads(out.text), PERSON)
        if not whitespace:
            assert not re.search(r"\s", out.text.replace(json.loads(out.text)["name"], ""))


def test_json_object_regex_choice_and_grammar(llm):
    ask = [{"role": "user", "content": "What is 12 times 3? Answer, then say if you are sure."}]
    regex = r"[0-9]{1,3} \((sure|unsure)\)"
    lark = 'start: expr\nexpr: NUM | expr OP expr | "(" expr ")"\nNUM: /[0-9]{1,2}/\nOP: "+" | "*" | "-"'
    params = [constrained("json_object", True, temperature=1.0, seed=5), constrained("regex", regex),
              constrained("choice", ["yes", "no", "it depends"], temperature=1.0, seed=6),
              constrained("grammar", lark, max_tokens=12)]
    obj, answer, choice, expr = llm.chat([ask] * len(params), params)
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(regex, answer.text) and answer.finish_reason == "stop", answer
    assert choice.text in ("yes", "no", "it depends") and choice.finish_reason == "stop"
    # An expression can always go on: it ends at max_tokens or EOS, a well-formed prefix either way.
    assert re.fullmatch(r"[0-9()+*\- ]+", expr.text) and expr.text.count("(") >= expr.text.count(")"), expr


def test_greedy_choice_is_the_models_best_allowed_token(llm):
    """Every greedy token is the one the model ranks first among those a fresh matcher allows
    (logprobs are the model's own, before the mask), and at least once the model's first choice
    was ruled out: the mask changed the answer."""
    spec = StructuredOutputs(json={"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})
    out = llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=40, logprobs=20, structured_outputs=spec))[0]
    matcher = llm.engine.grammars.matcher(spec)
    overruled = 0
    for entry in out.logprobs:
        allowed = _allowed(matcher)
        better = [t for t, lp in entry["top"] if lp > entry["logprob"]]
        assert entry["token_id"] in allowed and not set(better) & allowed, entry
        overruled += bool(better)
        assert matcher.consume_token(entry["token_id"])
    assert overruled and out.finish_reason == "stop" and "city" in json.loads(out.text)


def _allowed(matcher: llguidance.LLMatcher) -> set[int]:
    mask = int.from_bytes(matcher.compute_bitmask(), "little")
    return {t for t in range(mask.bit_length()) if mask >> t & 1}


def test_unconstrained_neighbours_are_untouched(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The"
    alone = llm.generate(prompt, plain)[0]
    mixed = llm.generate([prompt, prompt], [plain, constrained("choice", ["dog", "cat"])])
    assert mixed[0].token_ids == alone.token_ids
    assert mixed[1].text in ("dog", "cat")


TEAM = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "role": {"enum": ["dev", "ops"]},
                                     "years": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["name", "role", "years"], "additionalProperties": False}}


def test_constrained_drafts_give_the_tokens_plain_decoding_gives(llm):
    """JSON repeats its keys, so n-gram drafts find matches; each draft row is masked as the
    matcher stands after the drafts before it, and greedy output is token for token plain
    decoding's (an engine without speculation), sampled output still valid."""
    plain = LLM(dtype="float32")
    ask = [{"role": "user", "content": "List the four people of a small team as JSON."}]
    spec = StructuredOutputs(json=TEAM)
    before = llm.engine.stats()
    outs = llm.chat([ask] * 3, [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec),
                                SamplingParams(temperature=1.0, seed=7, max_tokens=200, structured_outputs=spec),
                                SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputs(
                                    json=TEAM, disable_any_whitespace=True))])
    after = llm.engine.stats()
    assert after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens > 20
    reference = plain.chat([ask] * 2, [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec),
                                       SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=
                                                      StructuredOutputs(json=TEAM, disable_any_whitespace=True))])
    assert [outs[0].token_ids, outs[2].token_ids] == [r.token_ids for r in reference]
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), TEAM)


def test_a_oneof_whose_branches_overlap_is_served_as_anyof(llm):
    # llguidance cannot prove these disjoint and refused the schema (a 400) without coerce_one_of.
    schema = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 10}]}},
              "required": ["n"], "additionalProperties": False}
    out = llm.generate("A number as JSON:", constrained("json", schema, temperature=0.0, max_tokens=30))[0]
    assert out.finish_reason == "stop", out
    assert isinstance(json.loads(out.text)["n"], (int, float))


def test_max_tokens_cuts_a_constrained_output_short(llm):
    out = llm.chat(ASK, constrained("json", PERSON, temperature=0.0, max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_complete_answer_ends_before_min_tokens(llm, temperature):
    """Once the answer is complete its grammar allows only EOS, which min_tokens would forbid: the
    grammar wins, and the request stops there rather than drawing a token neither allows."""
    params = constrained("choice", ["yes", "no"], temperature=temperature, seed=3, min_tokens=20)
    out = llm.chat([{"role": "user", "content": "Is the sky blue?"}], params)[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no"), out


@pytest.mark.parametrize("kind,value", [
    ("regex", "(a{1000}){1000}"),
    ("json", {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(ab{500}){500}$"}},
              "required": ["s"]}),
], ids=["regex", "json-pattern"])
def test_a_constraint_that_fails_while_generating_ends_in_error_not_stop(llm, kind, value):
    # These compile, then outgrow llguidance's lexer as tokens come: its mask then allows only EOS,
    # which must not end the request as a "stop" whose text claims to follow the constraint.
    out = llm.generate("Write the letter a many times:", constrained(kind, value, temperature=0.0, max_tokens=20))[0]
    assert out.finish_reason == "error" and "constraint failed while generating" in out.error, out
    assert "too many expressions" in out.error
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def chain(links: int) -> dict[str, str]:
    """A grammar of `links` rules each naming the next: llguidance compiles it by recursion."""
    return dict(grammar="start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(links)) + f'r{links}: "yes"\n')


def test_long_chains_of_rules_and_refs_compile_and_hold(llm):
    """5000 rules (a 70 KB grammar) or $refs: on an 8 MiB stack compiling them crashed the
    process (SIGSEGV), every request on the replica lost."""
    refs = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)} | {"d5000": {"enum": ["yes"]}},
            "$ref": "#/$defs/d0"}
    outs = llm.generate(["Say yes:", "Answer:"], [constrained("grammar", chain(5000)["grammar"], max_tokens=8),
                                                   constrained("json", refs, max_tokens=8)])
    assert [(o.text, o.finish_reason) for o in outs] == [("yes", "stop"), ('"yes"', "stop")]


@pytest.mark.parametrize("spec,message", [
    (chain(40_000), r"the grammar is too large: \d+ characters as a grammar, at most 524288"),
    (dict(json="[" * 5000 + "]" * 5000), "json is not a JSON schema"),  # a RecursionError, once a 500
    (dict(regex="[a-"), "the regex does not compile"),
    # llguidance dropped a final lone backslash: "a\\" was taken as /a/, "\\" as //.
    *[(dict(regex=r), "the regex does not compile: .*incomplete escape") for r in ("a\\", "\\", "a\\\\\\")],
    (dict(grammar="start: nothing_defined"), "the grammar does not compile"),
    (dict(json={"type": "martian"}), "the json does not compile"),
    (dict(json="{not json"), "json is not a JSON schema"),
    (dict(json='{"enum": [1e400, "a"]}'), "1e400 is out of a double's range"),  # was infinity, then null
    (dict(json="[1, 2]"), "a JSON schema is a JSON object"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_leaves_nothing(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputs(**spec)))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_a_regex_ending_in_an_escaped_backslash_is_kept():
    grammar = json.loads(to_grammar(StructuredOutputs(regex=r"a\\")))["grammars"][0]["lark_grammar"]
    assert grammar == r"start: /a\\/"  # "a" then a backslash


def test_a_constraint_is_compiled_once_for_all_its_choices(llm, monkeypatch):
    """n choices of one constrained request each compiled the grammar on the engine thread (a
    second for a large one: n=128 of a 40,000-way choice stalled every stream two minutes). The
    compiled matcher is kept and each choice gets its own copy, at the start of the output."""
    grammars = llm.engine.grammars
    compiles = []
    submit = grammars._compiler.submit
    monkeypatch.setattr(grammars._compiler, "submit", lambda *a, **kw: compiles.append(a) or submit(*a, **kw))
    spec = StructuredOutputs(choice=[f"option {i}" for i in range(300)])
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=8, structured_outputs=spec) for seed in range(4)]
    outs = llm.generate(["Pick one:"] * 4, params)  # as the server makes a request's n choices
    assert len(compiles) == 1
    texts = [o.text for o in outs]
    assert len(texts) == 4 and all(t in spec.choice for t in texts), texts
    first, second = grammars.matcher(spec), grammars.matcher(spec)  # kept: no compile, and apart
    assert len(compiles) == 1 and first is not second
    token = int(allowed_tokens([first.compute_bitmask()], grammars.vocab_size)[0].nonzero()[0])
    assert first.consume_token(token) and first.compute_bitmask() != second.compute_bitmask()


@pytest.mark.parametrize("spec,message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "choice must be a list of non-empty strings"),
    (dict(choice=["a", ""]), "choice must be a list of non-empty strings"),
    (dict(grammar=""), "grammar must be a non-empty string"),
])
def test_malformed_structured_outputs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**spec)
