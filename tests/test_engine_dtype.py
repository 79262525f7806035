"""`--dtype auto` by capability (issue 16): bf16 on CUDA and on CPUs with AVX512_BF16 or AMX,
float32 elsewhere; an explicit --dtype wins; the choice is logged and shown in /v1/models; the
operator passes spec.engine.dtype through."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from kiln.engine import config as config_module
from kiln.engine.config import Config
from kiln.engine.dtype_choice import BF16_CPU_FLAGS, auto_dtype, describe_dtype, host_cpu_flags
from kiln.engine.server import add_arguments
from kiln.operator.models import InferenceServiceSpec
from kiln.operator.engine_command import engine_args
from test_server import ServerProcess, get

# /proc/cpuinfo flags of the 2-core AMD EPYC (AVX2 and FMA, no AVX-512), shortened.
AVX2_EPYC = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2 sha_ni aes".split()
# A Sapphire Rapids Xeon: AVX-512 with BF16, and AMX.
SPR_XEON = AVX2_EPYC + "avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8".split()


@pytest.mark.parametrize("device_type, flags, want", [
    ("cpu", AVX2_EPYC, torch.float32),
    ("cpu", [], torch.float32),
    ("cpu", AVX2_EPYC + ["avx512f", "avx512bw"], torch.float32),  # AVX-512 without BF16: still emulated
    ("cpu", AVX2_EPYC + ["avx512_bf16"], torch.bfloat16),  # Zen 4, Cooper Lake
    ("cpu", AVX2_EPYC + ["amx_bf16", "amx_tile"], torch.bfloat16),
    ("cpu", ["AVX512_BF16"], torch.bfloat16),  # flag case does not matter
    ("cpu", SPR_XEON, torch.bfloat16),
    ("cuda", [], torch.bfloat16),
    ("cuda", AVX2_EPYC, torch.bfloat16),  # the host CPU does not matter on CUDA
])
def test_auto_dtype_follows_the_capability(device_type: str, flags: list[str], want: torch.dtype) -> None:
    assert auto_dtype(device_type, flags) == want
    print(device_type, sorted(BF16_CPU_FLAGS & set(flags)) or "-", "->", want)


def test_an_explicit_dtype_wins_over_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for the hardware (this machine's own flags are what they are): an AVX2-only CPU.
    monkeypatch.setattr(config_module, "host_cpu_flags", lambda: frozenset())
    assert Config(device="cpu").torch_dtype == torch.float32
    assert Config(device="cpu", dtype="bfloat16").torch_dtype == torch.bfloat16
    assert Config(device="cpu", dtype="float16").torch_dtype == torch.float16
    monkeypatch.setattr(config_module, "host_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert Config(device="cpu").torch_dtype == torch.bfloat16
    assert Config(device="cpu", dtype="float32").torch_dtype == torch.float32


def test_this_host_resolves_from_its_own_flags() -> None:
    flags = host_cpu_flags()
    cpuinfo = open("/proc/cpuinfo").read().split()
    # Every bf16 flag the kernel reports is seen; torch's probes may add to them, never remove.
    assert {f for f in BF16_CPU_FLAGS if f in cpuinfo} <= flags <= BF16_CPU_FLAGS
    config = Config(device="cpu")
    assert config.torch_dtype == auto_dtype("cpu", flags)
    print("this host:", sorted(flags) or "no bf16 flags", "->", config.dtype_reason)


def test_the_reason_names_what_decided() -> None:
    assert describe_dtype("float32", torch.float32, "cpu", SPR_XEON) == "float32 (--dtype float32)"
    assert "no AVX512_BF16 or AMX" in describe_dtype("auto", torch.float32, "cpu", AVX2_EPYC)
    assert "avx512_bf16" in describe_dtype("auto", torch.bfloat16, "cpu", SPR_XEON)
    assert describe_dtype("auto", torch.bfloat16, "cuda", []) == "bfloat16 (auto: cuda)"


def test_a_bad_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        Config(dtype="float64")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--dtype", "float64"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16", "float32"])
def test_the_operator_passes_spec_engine_dtype_through(dtype: str) -> None:
    spec = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"},
                                                "engine": {"dtype": dtype}})
    args = engine_args(spec, "smollm2-135m")
    assert args[args.index("--dtype") + 1] == dtype


def test_kiln_serve_logs_and_shows_the_dtype_it_runs() -> None:
    """Two real servers: `--dtype auto` resolves from this host's flags; `--dtype float32` wins."""
    expected_auto = str(auto_dtype("cpu", host_cpu_flags())).removeprefix("torch.")
    for extra, want in ((("--dtype", "auto"), expected_auto), ((), "float32")):  # ServerProcess passes float32
        server = ServerProcess("--device", "cpu", *extra)
        try:
            status, body = get(server.url + "/v1/models")
            card = json.loads(body)["data"][0]
            logged = [line.strip() for line in server.log if "dtype:" in line]
            print(extra or "(--dtype float32)", "->", card["dtype"], "| log:", logged[0].split("kiln.serve: ")[-1],
                  f"| ready after {server.ready_after:.1f}s")
            assert status == 200 and card["dtype"] == want
            assert len(logged) == 1 and f"dtype: {want} (" in logged[0]
            assert ("--dtype float32" in logged[0]) == (not extra)
        finally:
            server.stop()
