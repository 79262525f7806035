"""`kiln quantize`: write a model's quantized variant as a folder that `--model DIR` serves
(kiln.engine.quantized_folder), so replicas load the codes without quantizing again."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType

# config.QUANTIZATION_METHODS but "none", spelled out so that --help answers without importing torch
METHODS = ("int8", "int4", "int4-rtn", "fp8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="known name, model folder, or .gguf file")
    parser.add_argument("--method", required=True, choices=METHODS,
                        help="int8, int4, fp8 (activation-aware scaled, as AWQ), int4-rtn (plain round to nearest)")
    parser.add_argument("--out", required=True, type=Path, help="folder to write (new, empty, or a variant)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="precision the weights are quantized from and the float tensors are stored in")
    parser.add_argument("--device", default="cpu", help="where to compute (AWQ's calibration runs there)")
    parser.add_argument("--quantization-cache", default=None,
                        help="variant cache directory, or 'off' (default $KILN_CACHE/variants)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a variant in --out made from other weights or with another method")


def check_out_dir(out: Path) -> None:
    """out must be new, empty, or an earlier `kiln quantize` output (replaced: one of the same
    weights and method, or any with --overwrite), beside
    which the variant can be staged: found out now, not after minutes of quantizing."""
    from kiln.engine.quantized_folder import MARKER
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"--out {out} is not empty and holds no {MARKER}: refusing to write into it")
    # Tried in the nearest folder that exists, made by nothing: a run that fails later (a model not
    # found) left the parents of --out behind. write_quantized_folder makes them, and stages there.
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {parent}: {e.strerror or e}") from None


def _terminated(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (a Job's deadline, `timeout`) as an exception: the staging folder's cleanup runs.
    sys.exit(128 + signum)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _quantize(args)
    finally:
        signal.signal(signal.SIGTERM, before)


def _quantize(args: argparse.Namespace) -> int:
    try:
        check_out_dir(args.out)
        from kiln.engine.config import Config, ModelLoadError  # torch from here on
        from kiln.engine.loader import load_model, resolve_model_path
        from kiln.engine.quantized_folder import read_marker, write_quantized_folder
        from kiln.engine.variants import cache_dir, quantized_state_dict, weights_sha256

        # gguf_dequantize: a GGUF's Q4/Q8 projections would otherwise stay packed, and nothing is left to quantize.
        config = Config(model=args.model, dtype=args.dtype, device=args.device,
                        quantization_cache=args.quantization_cache, gguf_dequantize=True)
        path = resolve_model_path(args.model)
        if path.is_dir() and read_marker(path) is not None:
            raise ValueError(f"{path} is already a quantized variant; quantize the original model")
        try:
            earlier = read_marker(args.out) if args.out.is_dir() else None
        except ModelLoadError as e:  # another Kiln version's variant, or a damaged marker
            if not args.overwrite:
                raise ValueError(f"--out {args.out}: {e}; --overwrite replaces it") from None
            earlier = None
        if earlier is not None and not args.overwrite and \
                (earlier.get("source_sha256"), earlier.get("method")) != (weights_sha256(path), args.method):
            raise ValueError(f"--out {args.out} holds the {earlier.get('method')} variant of other weights or "
                             f"another method; --overwrite replaces it")
        loaded = load_model(config)
        state = quantized_state_dict(loaded.model, args.method, loaded.tokenizer, path, cache_dir(config))
        write_quantized_folder(args.out, loaded.model, loaded.model_config, loaded.tokenizer, args.method, state,
                               weights_sha256(path), path if path.is_dir() else None)
    except (ValueError, OSError) as e:
        print(f"kiln quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the {args.method} variant of {args.model} to {args.out}")
    return 0
