"""Quantized variants on the real SmolLM2-135M: the on-disk variant cache (kiln.engine.variants)
and `kiln quantize` folders (kiln.engine.quantized_folder) served with --model DIR."""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import shutil
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kiln.cli import main as kiln
from kiln.engine import quantize_cli, quantized_folder, variants
from kiln.engine.config import GENERATION_CONFIG, QUANTIZATION_METHODS, Config, ModelLoadError
from kiln.engine.evaluate import Scorer, attach_pool
from kiln.engine.llm import LLM
from kiln.engine.loader import load_model
from kiln.engine.quantization import Int8Linear, QuantLinear
from kiln.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):"]
GREEDY_TOKENS = 8


def quant_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b for m_name, m in model.named_modules() if isinstance(m, QuantLinear)
            for name, b in m.named_buffers(prefix=m_name)}


def test_second_load_reads_the_cache_instead_of_calibrating(smollm2_dequantized, smollm2_path, variant_cache,
                                                            caplog) -> None:
    config = Config(model=str(smollm2_path), dtype="float32", device="cpu", quantization="int4",
                    quantization_cache=str(variant_cache))
    first = copy.deepcopy(smollm2_dequantized.model)
    # computed here or by another test of the session: AWQ's calibration is the slow part
    variants.apply_quantization(first, config, smollm2_dequantized.tokenizer, smollm2_path)
    computed = variants.COMPUTED["int4"]
    with caplog.at_level(logging.INFO, logger="kiln.engine"):
        second = load_model(config).model
    assert variants.COMPUTED["int4"] == computed, "the second load calibrated AWQ again"
    assert "loaded cached int4 variant from" in caplog.text
    expected, loaded = quant_buffers(first), quant_buffers(second)
    assert expected.keys() == loaded.keys() and len(expected) == 4 * 30 * 3  # qweight, scales, zeros
    assert all(torch.equal(expected[k], loaded[k]) for k in expected)


def corrupt_tensors(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_tensors(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def garble_manifest(path: Path) -> None:
    path.with_suffix(".json").write_text('{"format_version": 1, "meth')


@pytest.mark.parametrize("damage", [corrupt_tensors, truncate_tensors, garble_manifest])
def test_damaged_cache_is_detected_and_rebuilt(smollm2_dequantized, smollm2_path, tmp_path, caplog, damage) -> None:
    model, tokenizer = smollm2_dequantized.model, smollm2_dequantized.tokenizer
    # int4-rtn: the one method without a calibration pass, so six computations stay cheap
    fresh = variants.quantized_state_dict(model, "int4-rtn", tokenizer, smollm2_path, tmp_path)
    [cached] = tmp_path.glob("*.safetensors")
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"
    damage(cached)
    computed = variants.COMPUTED["int4-rtn"]
    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        rebuilt = variants.quantized_state_dict(model, "int4-rtn", tokenizer, smollm2_path, tmp_path)
    assert "recomputing it" in caplog.text and str(tmp_path) in caplog.text
    assert variants.COMPUTED["int4-rtn"] == computed + 1
    assert fresh.keys() == rebuilt.keys() and all(torch.equal(fresh[k].float(), rebuilt[k].float()) for k in fresh)
    # the rewritten files verify: a third call reads them
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln.engine"):
        variants.quantized_state_dict(model, "int4-rtn", tokenizer, smollm2_path, tmp_path)
    assert variants.COMPUTED["int4-rtn"] == computed + 1 and "loaded cached int4-rtn variant" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_cache_directory_setting(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    assert variants.cache_dir(Config()) == tmp_path / "variants"
    assert variants.cache_dir(Config(quantization_cache="off")) is None
    assert variants.cache_dir(Config(quantization_cache=str(tmp_path / "x"))) == tmp_path / "x"
    # Random weights are keyed by the weight files they did not come from: never cached, never read.
    assert variants.cache_dir(Config(quantization_cache=str(tmp_path / "x"), load_format="dummy")) is None
    with pytest.raises(ValueError, match="quantization_cache must be a directory or 'off'"):
        Config(quantization_cache="")
    assert set(quantize_cli.METHODS) == set(QUANTIZATION_METHODS) - {"none"}
    from kiln.engine import cli, evaluate, server
    for module, extra in ((server, []), (cli, ["--prompt", "x"]), (evaluate, [])):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args(["--quantization-cache", "/v", *extra]).quantization_cache == "/v"


def engine_greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method", ["int8", "int4-rtn"])
def test_quantized_folder_round_trip(smollm2_dequantized, smollm2_path, variant_cache, tmp_path, method) -> None:
    out = tmp_path / "variant"
    assert kiln(["quantize", "--model", "smollm2-135m", "--method", method, "--out", str(out),
                 "--quantization-cache", str(variant_cache)]) == 0
    marker = json.loads((out / "kiln_quantization.json").read_text())
    assert marker["method"] == method and marker["format_version"] == variants.FORMAT_VERSION
    assert marker["source_sha256"] == variants.weights_sha256(smollm2_path)
    assert marker["group_sizes"] == ([64, 128] if method == "int4-rtn" else None)  # K = 576 and 1536
    # Readable by every user: a pod that is not the user who quantized (hostPath, init container) serves it.
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert all(int(mode, 8) & 0o444 == 0o444 for mode in modes.values()), modes

    # the on-the-fly variant (same cache: no second quantization) against the folder through the engine
    config = Config(model=str(smollm2_path), dtype="float32", device="cpu", quantization=method,
                    quantization_cache=str(variant_cache))
    on_the_fly = copy.deepcopy(smollm2_dequantized.model)
    variants.apply_quantization(on_the_fly, config, smollm2_dequantized.tokenizer, smollm2_path)
    prompts = [smollm2_dequantized.tokenizer.encode(p) for p in PROMPTS]
    pool = attach_pool(on_the_fly, smollm2_dequantized.model_config, config, len(prompts), 64)
    expected = Scorer(on_the_fly, pool).greedy(prompts, GREEDY_TOKENS)
    computed = dict(variants.COMPUTED)
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=1 << 24, max_model_len=256)
    assert dict(variants.COMPUTED) == computed, "loading the folder quantized again"
    assert sum(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules()) == 4 * 30
    # Read in place from the file, int8 weights sat 8 bytes off a 16-byte line, where torch's int8
    # kernel with bf16 activations (dtype auto on an AVX512-BF16 CPU) crashed the process.
    assert all(m.qweight.data_ptr() % 64 == 0 for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear))
    assert engine_greedy(llm) == expected
    chat = [{"role": "user", "content": "Hi"}]
    assert llm.tokenizer.apply_chat_template(chat) == smollm2_dequantized.tokenizer.apply_chat_template(chat)
    assert llm.tokenizer.eos_token_ids == smollm2_dequantized.tokenizer.eos_token_ids

    assert load_model(replace(config, model=str(out))).model is not None  # the same method is fine
    other = "fp8"
    with pytest.raises(ModelLoadError, match=f"holds a {method} variant; quantization 'fp8' disagrees"):
        load_model(replace(config, model=str(out), quantization=other))
    assert kiln(["quantize", "--model", str(out), "--method", method, "--out", str(tmp_path / "again")]) == 2


QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.mark.parametrize("tamper,message", [
    (lambda t, m: t.pop(f"{QKV}.scales"), rf"missing tensors \['{QKV}.scales'\]"),  # was an AttributeError
    (lambda t, m: t.update({f"{QKV}.scales": t[f"{QKV}.scales"][:10]}),
     rf"the int8 tensors of {QKV} do not fit the model"),  # was a RuntimeError at the first request
    (lambda t, m: t.update({f"{QKV}.qweight": t[f"{QKV}.qweight"][:, :32].contiguous()}),
     rf"the int8 tensors of {QKV} do not fit the model"),
    (lambda t, m: t.update({f"{QKV}.qweight": t[f"{QKV}.qweight"].float()}), "do not fit the model"),
    (lambda t, m: m.update(method="int4"), r"missing tensors \['.*\.zeros'"),  # was an IndexError
    (lambda t, m: m.update(method="none"), "method 'none' is no quantized variant"),  # was served as fp8
    (lambda t, m: t.pop("model.layers.1.self_attn.o_proj.act_scale"),  # AWQ's s: W diag(s) served on x, not x / s
     r"missing tensors \['model\.layers\.1\.self_attn\.o_proj\.act_scale'\]"),
    (lambda t, m: t.pop("model.layers.0.input_layernorm.folded_scale"),
     r"missing tensors \['model\.layers\.0\.input_layernorm\.folded_scale'\]"),
    # Loaded, and served wrong in silence: a scale broadcast as one, a NaN, a tensor nobody reads.
    (lambda t, m: t.update({"model.layers.1.self_attn.o_proj.act_scale": t["model.layers.1.self_attn.o_proj.act_scale"][:1]}),
     r"tensor model\.layers\.1\.self_attn\.o_proj\.act_scale has shape \(1,\), the model expects \(\d+,\)"),
    (lambda t, m: t.update({"model.layers.0.input_layernorm.folded_scale":
                            t["model.layers.0.input_layernorm.folded_scale"][:1]}),
     r"tensor model\.layers\.0\.input_layernorm\.folded_scale has shape \(1,\)"),
    (lambda t, m: t[f"{QKV}.scales"].view(-1)[0].fill_(float("nan")), rf"tensor {QKV}\.scales holds values that are not"),
    (lambda t, m: t.update({"model.layers.0.extra": t[f"{QKV}.scales"].clone()}), r"unexpected tensors \['model\.layers\.0\.extra'\]"),
], ids=["no-scales", "short-scales", "narrow-codes", "float-codes", "int4-marker", "none-marker", "no-act-scale",
        "no-folded-scale", "short-act-scale", "short-folded-scale", "nan-scales", "extra-tensor"])
def test_a_damaged_quantized_folder_is_named_at_load(tiny_llama_dir, tmp_path, tamper, message) -> None:
    out = tmp_path / "variant"
    assert kiln(["quantize", "--model", str(tiny_llama_dir), "--method", "int8", "--out", str(out),
                 "--quantization-cache", "off"]) == 0
    tensors = safetensors.torch.load_file(out / quantized_folder.WEIGHTS)
    marker = json.loads((out / quantized_folder.MARKER).read_text())
    tamper(tensors, marker)
    safetensors.torch.save_file(tensors, out / quantized_folder.WEIGHTS)
    (out / quantized_folder.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ModelLoadError, match=message):
        load_model(Config(model=str(out), dtype="float32", device="cpu"))


def test_quantize_refuses_bad_input(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        kiln(["quantize", "--method", "int3", "--out", str(tmp_path / "a")])
    assert exit_.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert kiln(["quantize", "--method", "int8", "--out", str(busy)]) == 2
    assert "kiln quantize: error: --out" in capsys.readouterr().err and (busy / "notes.txt").read_text() == "mine"
    assert kiln(["quantize", "--model", str(tmp_path / "missing"), "--method", "int8", "--out",
                 str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln quantize: error: model") and "not found" in err
    # The folders above --out are made when the variant is written, not left by a run that failed.
    assert kiln(["quantize", "--model", str(tmp_path / "missing"), "--method", "int8", "--out",
                 str(tmp_path / "deep" / "a" / "out")]) == 2
    assert not (tmp_path / "deep").exists()


def test_quantize_refuses_an_unwritable_out_before_loading(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    assert kiln(["quantize", "--model", str(tmp_path / "missing"), "--method", "int8",
                 "--out", str(tmp_path / "file" / "variant")]) == 2
    assert capsys.readouterr().err.startswith(f"kiln quantize: error: --out {tmp_path / 'file' / 'variant'}: "
                                              f"cannot write in")


def test_quantize_cut_short_leaves_the_earlier_variant(tiny_hf_models, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "variant"
    assert kiln(["quantize", "--model", str(tiny_hf_models["llama"]), "--method", "int8", "--out", str(out),
                 "--quantization-cache", "off"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    # The weights fail after config.json and the tokenizer were written: the old marker vouched
    # for Qwen2's config over Llama's weights.
    monkeypatch.setattr(quantized_folder.safetensors.torch, "save", disk_full)
    for folder in (out, tmp_path / "new"):
        assert kiln(["quantize", "--model", str(tiny_hf_models["qwen2"]), "--method", "int8", "--out", str(folder),
                     "--quantization-cache", "off", "--overwrite"]) == 2
        assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["variant"]  # no staging folder, no half-made "new"


def test_quantize_replaces_only_its_own_variant_and_a_sigterm_leaves_no_staging(tiny_hf_models, tmp_path,
                                                                              monkeypatch, capsys) -> None:
    out = tmp_path / "variant"
    llama = ["quantize", "--model", str(tiny_hf_models["llama"]), "--out", str(out), "--quantization-cache", "off"]
    assert kiln([*llama, "--method", "int8"]) == 0
    assert kiln([*llama, "--method", "int8"]) == 0  # the same again: replaced, as a rerun expects
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for other in ([*llama, "--method", "int4-rtn"], ["quantize", "--model", str(tiny_hf_models["qwen2"]),
                                                     "--method", "int8", "--out", str(out), "--quantization-cache", "off"]):
        capsys.readouterr()
        assert kiln(other) == 2
        assert "holds the int8 variant of other weights or another method; --overwrite replaces it" in \
            capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def terminated(*_: object, **__: object) -> None:  # SIGTERM while the weights are written
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(quantized_folder.safetensors.torch, "save", terminated)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_:
        kiln([*llama, "--method", "int4-rtn", "--overwrite"])
    assert exit_.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == handler
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["variant"]  # the staging folder is gone


def test_overwrite_replaces_a_damaged_variant_and_leaves_none_of_its_files(tiny_hf_models, tmp_path,
                                                                           capsys) -> None:
    """--overwrite replaces what the error told to quantize again (another version's marker, a
    damaged one), and the earlier source's sampling defaults do not outlive it."""
    source = tmp_path / "llama"
    shutil.copytree(tiny_hf_models["llama"], source)
    (source / GENERATION_CONFIG).write_text(json.dumps({"temperature": 0.3}))
    out = tmp_path / "variant"
    base = ["quantize", "--method", "int8", "--out", str(out), "--quantization-cache", "off"]
    assert kiln([*base, "--model", str(source)]) == 0 and (out / GENERATION_CONFIG).is_file()
    (out / quantized_folder.MARKER).write_text("{")
    other = tmp_path / "qwen2"
    shutil.copytree(tiny_hf_models["qwen2"], other)
    (other / GENERATION_CONFIG).unlink()
    capsys.readouterr()
    assert kiln([*base, "--model", str(other)]) == 2
    assert "unreadable" in (err := capsys.readouterr().err) and "--overwrite replaces it" in err
    assert kiln([*base, "--model", str(other), "--overwrite"]) == 0
    assert quantized_folder.read_marker(out)["method"] == "int8"
    assert not (out / GENERATION_CONFIG).exists()  # qwen2's folder has none: no temperature 0.3 from llama's


@pytest.fixture(scope="module")
def tiny_rtn(tiny_llama_dir):
    """The tiny Llama's float model and its int4-rtn state dict, for write_quantized_folder."""
    loaded = load_model(Config(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    return loaded, variants.quantized_state_dict(loaded.model, "int4-rtn", loaded.tokenizer, tiny_llama_dir, None)


def write_variant(out: Path, tiny_rtn, state: dict[str, torch.Tensor] | None = None, sha: str = "a" * 64) -> None:
    loaded, rtn = tiny_rtn
    quantized_folder.write_quantized_folder(out, loaded.model, loaded.model_config, loaded.tokenizer, "int4-rtn",
                                            rtn if state is None else state, sha)


def test_a_variant_cut_short_while_moved_in_is_refused_at_load_and_written_again(tiny_rtn, tiny_llama_dir,
                                                                                 tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """Ctrl-C between the renames into --out: the marker was gone and some files new, so the folder
    loaded as no variant and kiln quantize refused to write into it, --overwrite or not."""
    out = (tmp_path / "variant").resolve()
    write_variant(out, tiny_rtn)
    replace, moved = os.replace, []

    def interrupted(src: str, dst: str) -> None:
        if Path(dst).parent == out and not Path(src).name.endswith(".tmp"):  # a staged file, not atomic_write's
            moved.append(dst)
            if len(moved) == 2:
                raise KeyboardInterrupt
        replace(src, dst)
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_variant(out, tiny_rtn)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ModelLoadError, match="did not finish"):
        load_model(Config(model=str(out), dtype="float32", device="cpu"))
    assert kiln(["quantize", "--model", str(tiny_llama_dir), "--method", "int4-rtn", "--out", str(out)]) == 2
    assert "did not finish" in (err := capsys.readouterr().err) and "--overwrite replaces it" in err
    quantize_cli.check_out_dir(out)  # what --overwrite does next: write it again
    write_variant(out, tiny_rtn)
    assert quantized_folder.read_marker(out)["method"] == "int4-rtn"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["variant"]


def test_two_runs_into_one_folder_leave_one_whole_variant(tiny_rtn, tmp_path, monkeypatch) -> None:
    """Concurrent runs into one --out: their renames interleaved, and the last marker vouched for
    the other run's weights."""
    out = tmp_path / "variant"
    rtn = tiny_rtn[1]
    other = {k: v * 2 if k.endswith(".scales") else v for k, v in rtn.items()}
    paused, go, errors = threading.Event(), threading.Event(), []
    replace = os.replace

    def held(src: str, dst: str) -> None:  # the first run stops before its marker goes in
        if Path(src).name == quantized_folder.MARKER and threading.current_thread().name == "first":
            paused.set()
            go.wait(60)
        replace(src, dst)

    def run(state: dict[str, torch.Tensor], sha: str) -> None:
        try:
            write_variant(out, tiny_rtn, state, sha)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)
    monkeypatch.setattr(os, "replace", held)
    first = threading.Thread(target=run, args=(rtn, "a" * 64), name="first")
    second = threading.Thread(target=run, args=(other, "b" * 64), name="second")
    first.start()
    assert paused.wait(60)
    second.start()
    second.join(5)  # done where nothing holds it back; waiting for the first, where the folder is locked
    go.set()
    first.join(60)
    second.join(60)
    assert not errors and not first.is_alive() and not second.is_alive()
    scales = next(k for k in rtn if k.endswith(".scales"))
    written = "b" if torch.equal(safetensors.torch.load_file(out / quantized_folder.WEIGHTS)[scales], other[scales]) \
        else "a"
    assert quantized_folder.read_marker(out)["source_sha256"] == written * 64


def test_a_shorter_max_model_len_calibrates_into_its_own_variant(smollm2_path, tmp_path, caplog) -> None:
    """max_model_len cuts AWQ's calibration text into shorter sequences, which changes the variant:
    it is cached under its own key, so a server with the full context never reads it (a stale
    short-context variant once made a pod and the test process disagree on greedy text)."""
    def load(max_model_len: int, cache: Path) -> dict[str, torch.Tensor]:
        config = Config(model=str(smollm2_path), dtype="float32", device="cpu", quantization="int8",
                        max_model_len=max_model_len, quantization_cache=str(cache))
        return quant_buffers(load_model(config).model)

    short, full = load(256, tmp_path), load(2048, tmp_path)
    assert sorted(re.sub(r"-c[0-9a-f]{16}-", "-", p.name.split("-", 1)[1]) for p in tmp_path.glob("*.json")) == [
        f"int8-float32-v{variants.FORMAT_VERSION}.json", f"int8-float32-w256-v{variants.FORMAT_VERSION}.json"]
    assert any(not torch.equal(short[k], full[k]) for k in full)
    # A manifest from before the window was recorded may hold a short-context variant: recomputed.
    [manifest] = [m for m in tmp_path.glob("*.json") if "-w256-" not in m.name]
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                    if k != "calibration_window"}))
    computed = variants.COMPUTED["int8"]
    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        again = load(2048, tmp_path)
    assert variants.COMPUTED["int8"] == computed + 1 and "recomputing it" in caplog.text
    assert all(torch.equal(again[k], full[k]) for k in full)  # the same variant: calibration is deterministic


def test_an_edited_config_calibrates_anew_and_an_unsearchable_cache_is_recomputed(tiny_hf_models, tmp_path,
                                                                                  monkeypatch, caplog) -> None:
    """AWQ's calibration runs the model as its config.json says (rope, norms), which the weights'
    sha256 does not cover: an edited config is its own variant, not the old config's. A cache
    directory this user may not search costs a recompute, not the start."""
    source, cache = tmp_path / "llama", tmp_path / "cache"
    shutil.copytree(tiny_hf_models["llama"], source)

    def load() -> None:
        load_model(Config(model=str(source), dtype="float32", device="cpu", quantization="int8",
                          quantization_cache=str(cache)))
    load()
    computed = variants.COMPUTED["int8"]
    load()
    assert variants.COMPUTED["int8"] == computed  # the same config: read back
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    load()
    assert variants.COMPUTED["int8"] == computed + 1 and len(list(cache.glob("*.json"))) == 2

    def denied(path: Path) -> bool:  # stands in for a non-root user: the tests run as root
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(Path, "exists", denied)
    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        assert variants.read_cached(cache, "any-key", {}) is None
    assert "Permission denied" in caplog.text and "recomputing it" in caplog.text


def test_a_variant_keeps_its_models_templates_sampling_defaults_and_needs_its_biases(tiny_hf_models, tmp_path) -> None:
    from kiln.engine.sampling_defaults import sampling_defaults
    source = tmp_path / "qwen2"
    shutil.copytree(tiny_hf_models["qwen2"], source)
    # Named templates (a tool_use one for requests with tools): both kept, or tools went unsaid.
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": [
        {"name": "default", "template": "D {{ messages[0].content }}"},
        {"name": "tool_use", "template": "T {{ tools | length }} {{ messages[0].content }}"}]}))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    (source / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    out = tmp_path / "variant"
    assert kiln(["quantize", "--model", str(source), "--method", "int8", "--out", str(out),
                 "--quantization-cache", "off"]) == 0
    # Without the file, the variant sampled at the API's temperature 1 where its model samples at 0.6.
    assert sampling_defaults("auto", out) == sampling_defaults("auto", source) == {"temperature": 0.6, "top_p": 0.9}
    served = load_model(Config(model=str(out), dtype="float32", device="cpu")).tokenizer
    chat = [{"role": "user", "content": "w1"}]
    assert (served.apply_chat_template(chat), served.apply_chat_template(chat, tools=[{"type": "function"}])) == \
        ("D w1", "T 1 w1")
    # Qwen2's q/k/v biases left out of the folder: it loaded, and answered wrong without a word.
    tensors = safetensors.torch.load_file(out / quantized_folder.WEIGHTS)
    tensors.pop(f"{QKV}.bias")
    safetensors.torch.save_file(tensors, out / quantized_folder.WEIGHTS)
    with pytest.raises(ModelLoadError, match=rf"missing tensors \['{QKV}.bias'\]"):
        load_model(Config(model=str(out), dtype="float32", device="cpu"))
