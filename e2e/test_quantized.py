"""A quantized variant through the whole system: spec.engine.quantization, kvCache.dtype and
speculative (ngram) reach the engine, the revision reports its quantization, and the greedy answer
equals what the engine gives in-process with the same settings (so the pod really serves the
quantized model)."""
from __future__ import annotations

import json

import openai
import pytest
import yaml

from e2e_support import LOAD_TIMEOUT, MODEL, PROMPT, REPO, Target
from kiln.operator.render import selector_string

NAME = "smollm2-int8"

pytestmark = pytest.mark.timeout(1800)


def test_an_int8_variant_with_an_int8_kv_cache_serves_its_own_greedy_text(target: Target, namespace: str,
                                                                          operator: None, base_url) -> None:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = NAME
    body["spec"]["engine"]["quantization"] = "int8"
    body["spec"]["engine"]["kvCache"]["dtype"] = "int8"
    body["spec"]["engine"]["speculative"] = {"method": "ngram", "numTokens": 3}
    target.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    try:
        target.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"--timeout={LOAD_TIMEOUT}s",
                       f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)
        status = json.loads(target.kubectl("get", "isvc", NAME, "-n", namespace, "-o", "json"))["status"]
        assert [r["quantization"] for r in status["revisions"]] == ["int8"]
        engines = json.loads(target.kubectl("get", "deployment", "-n", namespace, "-l", selector_string(NAME),
                                            "-o", "json"))["items"]
        command = engines[0]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--speculative-config") + 1] == '{"method": "ngram", "num_speculative_tokens": 3}'

        from kiln.engine import LLM, SamplingParams
        from kiln.engine.speculative import SpeculativeConfig
        llm = LLM(MODEL, dtype="float32", device="cpu", kv_cache_memory=256 << 20, max_model_len=2048,
                  quantization="int8", kv_cache_dtype="int8", speculative=SpeculativeConfig(num_speculative_tokens=3))
        expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24))[0].text
        api = openai.OpenAI(base_url=base_url(NAME) + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected
    finally:
        target.kubectl("delete", "isvc", NAME, "-n", namespace, "--wait=false", check=False)
