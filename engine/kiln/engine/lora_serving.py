"""LoRA adapters on `kiln serve`, with vLLM's flags and endpoints: `--enable-lora --lora-modules
name=path`, each adapter listed by /v1/models and served under its name as the OpenAI `model`,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter to change the set while serving, and
`--max-cpu-loras` to bound how many are loaded at once (kiln.engine.lora_cache)."""
from __future__ import annotations

import argparse
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiln.engine.lora import LoRAError, adapter_files
from kiln.engine.lora_cache import LoRACapacityError
from kiln.engine.api_errors import APIError, parse_request
from kiln.engine.openai_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


def lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry: name=path, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.startswith("{"):
        try:
            entry = json.loads(text)
            name, path = entry["name"], entry["path"]
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f'not {{"name": ..., "path": ...}}: {text}') from None
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path (an adapter's name and its PEFT folder), got {text!r}")
    return name, path


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters beside the model: requests name one as their model")
    # extend: a second --lora-modules adds to the first (store would drop its adapters without a word)
    parser.add_argument("--lora-modules", type=lora_module, nargs="+", action="extend", default=[],
                        metavar="NAME=PATH", help="adapters (PEFT folders) loaded at start, each served under its name")
    parser.add_argument("--max-loras", type=int, default=1,
                        help="distinct adapters one batch may mix; requests of others wait for a seat")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest rank an adapter may have")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters loaded at once (default: max(--max-loras, 8)): the least recently used one "
                             "no request holds is unloaded for another and read again from its folder when named")


def check_modules(lora_modules: list[tuple[str, str]], model_name: str) -> None:
    """ValueError for names a request could not tell apart, and for a path that is no PEFT folder:
    said before the server listens, not as a failed start once it does."""
    names = [name for name, _ in lora_modules]
    if model_name in names:
        raise ValueError(f"--lora-modules: {model_name!r} is the served model's name")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules: {', '.join(duplicates)} given more than once")
    for name, path in lora_modules:
        try:
            adapter_files(name, path)
        except LoRAError as e:
            raise ValueError(f"--lora-modules {name}={path}: not a PEFT adapter folder ({e})") from None


def model_cards(engine: AsyncEngine | None, model_name: str, base: dict[str, Any]) -> list[dict[str, Any]]:
    """/v1/models: the base model's card, then one per adapter naming its parent (as vLLM does)."""
    # A copy taken at once: the engine thread may load or unload one while this loop runs.
    loras = list(engine.engine.loras.paths.items()) if engine is not None else []
    return [base] + [{"id": name, "object": "model", "created": 0, "owned_by": "kiln", "root": path,
                      "parent": model_name} for name, path in loras]


async def load_lora_adapter(engine: AsyncEngine, model_name: str, request: web.Request) -> web.Response:
    req: LoadLoRAAdapterRequest = parse_request(LoadLoRAAdapterRequest, await request.read())
    _check_enabled(engine)
    if req.lora_name == model_name:
        raise APIError(400, f"{req.lora_name!r} is the served model's name", param="lora_name")
    try:
        adapter = await engine.call(lambda: engine.engine.add_lora(req.lora_name, req.lora_path, req.load_inplace))
    except LoRAError as e:  # a folder that cannot be served
        raise APIError(400, str(e), param="lora_path") from None
    except LoRACapacityError as e:
        raise capacity_error(e) from None
    except ValueError as e:  # the name: empty, or taken
        raise APIError(400, str(e), param="lora_name") from None
    log.info("LoRA adapter %r loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(engine: AsyncEngine, request: web.Request) -> web.Response:
    req: UnloadLoRAAdapterRequest = parse_request(UnloadLoRAAdapterRequest, await request.read())
    _check_enabled(engine)
    try:
        users = await engine.call(lambda: engine.engine.remove_lora(req.lora_name))
    except KeyError:
        raise APIError(404, f"no LoRA adapter named {req.lora_name!r} is loaded", param="lora_name",
                       code="model_not_found") from None
    log.info("LoRA adapter %r unloaded%s", req.lora_name,
             f"; the {users} request(s) using it finish with it first" if users else "")
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def capacity_error(e: LoRACapacityError) -> APIError:
    """A 429 (the server adds Retry-After): the requests holding the loaded adapters finish, and a
    retry finds room."""
    return APIError(429, str(e), code="lora_capacity", type_="rate_limit_error")


def _check_enabled(engine: AsyncEngine) -> None:
    if not engine.engine.config.enable_lora:
        raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)")
