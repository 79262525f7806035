"""`kiln eval` (kiln.engine.evaluate) on the real SmolLM2-135M: each quantized variant against
the float model it came from, on the held-out text and the reference's greedy continuations."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from kiln.cli import main as kiln
from kiln.engine import evaluate as ev
from kiln.engine import variants
from kiln.engine.awq import calibration_text
from kiln.engine.config import Config


@pytest.fixture(scope="module")
def reference(smollm2_dequantized):
    """(scorer, prompts and greedy continuations) of the float model, computed once."""
    owned = copy.deepcopy(smollm2_dequantized.model)  # the KV pool for generating stays on the copy
    config = Config(dtype="float32", device="cpu")
    prompts = [smollm2_dequantized.tokenizer.encode(p) for p in ev.eval_prompts()]
    pool = ev.attach_pool(owned, smollm2_dequantized.model_config, config, len(prompts),
                          max(len(p) for p in prompts) + ev.CONTINUATION_TOKENS)
    continuations = ev.Scorer(owned, pool).greedy(prompts, ev.CONTINUATION_TOKENS)
    return ev.Scorer(smollm2_dequantized.model), (prompts, continuations)


@pytest.fixture(scope="module")
def results(smollm2_dequantized, smollm2_path, variant_cache, reference) -> dict[str, ev.EvalResult]:
    """Every method's EvalResult, one quantized copy at a time."""
    scorer, continuations = reference
    config = Config(model=str(smollm2_path), dtype="float32", device="cpu", quantization_cache=str(variant_cache))
    out = {}
    for method in ("int8", "fp8", "int4-rtn", "int4"):
        model = copy.deepcopy(smollm2_dequantized.model)
        variants.apply_quantization(model, replace(config, quantization=method), smollm2_dequantized.tokenizer,
                                    smollm2_path)
        out[method] = ev.evaluate(scorer, ev.Scorer(model), smollm2_dequantized.tokenizer, method,
                                  continuations=continuations)
        print(out[method].table())
    return out


def test_greedy_agreement_definition() -> None:
    assert ev.greedy_agreement([[1, 2, 3], [4]], [[1, 9, 3], [4]]) == 0.75
    with pytest.raises(ValueError, match="differ in shape"):
        ev.greedy_agreement([[1, 2]], [[1]])
    with pytest.raises(ValueError, match="no continuation tokens"):
        ev.greedy_agreement([[]], [[]])


def test_shipped_texts() -> None:
    text = ev.heldout_text()
    assert text.startswith("It was the best of times") and len(text) > 4000
    assert text[:200] not in calibration_text()
    assert 8 <= len(ev.eval_prompts()) <= 16


def test_reference_agrees_with_itself(smollm2_dequantized, reference) -> None:
    scorer, continuations = reference
    result = ev.evaluate(scorer, scorer, smollm2_dequantized.tokenizer, "none", continuations=continuations)
    assert result.agreement == 1.0 and result.mean_kl == 0.0 and result.ppl_ratio == 1.0
    assert len(smollm2_dequantized.tokenizer.encode(ev.heldout_text())) > ev.MAX_HELDOUT_TOKENS
    assert result.tokens_scored == ev.MAX_HELDOUT_TOKENS - ev.MAX_HELDOUT_TOKENS // ev.WINDOW  # each window's first
    assert result.agreement_tokens == len(ev.eval_prompts()) * ev.CONTINUATION_TOKENS


def test_int8_stays_close(results) -> None:
    int8 = results["int8"]
    assert abs(int8.ppl_ratio - 1) < 0.01, int8.to_dict()
    assert int8.agreement >= 0.95, int8.to_dict()  # a regression guard below the goal (next test)
    assert int8.linear_bytes_variant < 0.3 * int8.linear_bytes_ref  # int8 codes vs float32


def test_int8_agreement_goal(results) -> None:
    assert results["int8"].agreement >= 0.97, results["int8"].to_dict()


def test_fp8_perplexity_goal(results) -> None:
    assert results["fp8"].ppl_ratio < 1.02, results["fp8"].to_dict()


def test_error_grows_as_bits_shrink(results) -> None:
    kl = {method: r.mean_kl for method, r in results.items()}
    assert kl["int8"] < kl["fp8"] < kl["int4"] < kl["int4-rtn"], kl
    assert results["fp8"].ppl_ratio < 1.05 and results["fp8"].agreement >= 0.9, results["fp8"].to_dict()


def test_awq_beats_round_to_nearest(results) -> None:
    awq, rtn = results["int4"], results["int4-rtn"]
    assert awq.perplexity_variant < rtn.perplexity_variant and awq.mean_kl < rtn.mean_kl, (awq, rtn)


def test_cli_json_with_a_quantized_kv_cache(variant_cache, capsys) -> None:
    assert kiln(["eval", "--quantization", "int8", "--kv-cache-dtype", "int8", "--json",
                 "--quantization-cache", str(variant_cache)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "int8" and result["kv_cache_dtype"] == "int8"
    assert result["ppl_ratio"] == pytest.approx(result["perplexity_variant"] / result["perplexity_ref"])
    assert 0 < result["mean_kl"] < 0.05 and result["agreement"] >= 0.9 and result["tokens_scored"] > 900
    assert result["linear_bytes_variant"] < result["linear_bytes_ref"]


def test_cli_refuses_bad_input(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        kiln(["eval", "--quantization", "int3"])
    assert exit_.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    assert kiln(["eval", "--model", str(tmp_path / "missing"), "--quantization", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln eval: error: model") and "not found" in err
    assert kiln(["eval"]) == 2  # the defaults: the model against itself, a table of zeros
    assert "nothing to compare" in capsys.readouterr().err


def test_cli_on_a_model_with_a_short_context(tmp_path, capsys) -> None:
    """Held-out windows shrink to the model's context (positions past it crashed the forward);
    a context too short for the prompts is refused in one line."""
    from tiny_models import write_tiny_model

    short = write_tiny_model("llama", tmp_path / "short", max_position_embeddings=128)
    assert kiln(["eval", "--model", str(short), "--quantization", "int8", "--kv-cache-dtype", "int8", "--json",
                 "--quantization-cache", "off"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens_scored"] > 900 and result["agreement_tokens"] > 0
    tiny = write_tiny_model("llama", tmp_path / "tiny", max_position_embeddings=16)
    assert kiln(["eval", "--model", str(tiny), "--quantization", "int8", "--quantization-cache", "off"]) == 2
    assert "kiln eval: error: the model's context of 16 tokens is shorter" in capsys.readouterr().err
