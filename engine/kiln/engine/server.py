"""`kiln serve`: the OpenAI-compatible HTTP server.

The listener starts first so /health answers while weights load; /ready turns 200 once the
engine is built and one warm-up generation has run. SIGTERM drains: new requests get 503,
/ready goes false, in-flight requests finish, and the process exits 0 within --drain-timeout.
A fatal engine error (async_engine) fails every request and turns /health and /ready to 503.
Each phase of the cold start is logged at ready and exported (kiln.engine.startup)."""
from __future__ import annotations

# First: the cold start's "imports" phase is what the imports below take.
from kiln.engine import startup  # isort: skip

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.engine import Config, LLMEngine, SamplingParams, lora_serving, openapi, tool_parsers
from kiln.engine.async_engine import AsyncEngine, EngineDeadError, TorchThread, fault_step_from_env
from kiln.engine.cli import add_memory_arguments, add_quantization_arguments
from kiln.engine.cpus import configure_torch_threads
from kiln.engine.loader import resolve_model_path
from kiln.engine.metrics import ServerMetrics
from kiln.engine.api_errors import APIError, model_not_found, unreadable_body
from kiln.engine.openai_serving import OpenAIServing
from kiln.engine.output_streams import DEFAULT_WRITE_TIMEOUT_S
from kiln.engine.responses_api import ResponsesServing
from kiln.engine.sampling_defaults import sampling_defaults
from kiln.engine.speculative import SpeculativeConfig
from kiln.engine.tokenizer import read_chat_template
from kiln.listening import listening_sockets
from kiln.router import auth

log = logging.getLogger("kiln.serve")

GIL_SWITCH_INTERVAL_S = 0.0005  # see serve()
RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves every engine step, so soon is right
def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not (math.isfinite(value) and value > 0):  # nan compares False with everything
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def served_name(model: str) -> str:
    """The name clients use when --served-model-name is not given: a known model's name as given,
    a folder's whole name (SmolLM2-1.7B-Instruct, dots and all), a .gguf file's without the suffix."""
    if "/" not in model:
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text}")
    return port


class Server:
    def __init__(self, config: Config, model_name: str, max_queue: int, timer: startup.StartupTimer,
                 max_queued_tokens: int | None = None, fault_step: int | None = None,
                 tool_call_parser: str | None = None, api_keys: auth.ApiKeys | None = None,
                 sampling_defaults: dict[str, float | int] | None = None,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        self.config, self.model_name, self.max_queue, self.startup = config, model_name, max_queue, timer
        self.sampling_defaults, self.write_timeout = sampling_defaults, write_timeout
        self.max_queued_tokens, self.fault_step, self.tool_call_parser = max_queued_tokens, fault_step, tool_call_parser
        self.metrics = ServerMetrics(model_name)
        self.engine: AsyncEngine | None = None
        self.torch_thread = TorchThread()  # loads, warms up and then runs the engine (one OpenMP team)
        self.serving: OpenAIServing | None = None
        self.responses_api: ResponsesServing | None = None
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        keys = [auth.middleware(api_keys)] if api_keys else []  # first: a request without a key gets nothing else
        self.app = web.Application(middlewares=[*keys, self._errors, self._admission], client_max_size=16 * 2**20)
        self.app.add_routes([
            web.get("/health", self.health), web.get("/ready", self.ready), web.get("/metrics", self.metrics_),
            web.get("/v1/models", self.models), web.get("/v1/models/{model:.+}", self.model),
            web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
            web.post("/v1/responses", self.responses),
            web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
            web.post("/sleep", self.sleep), web.post("/wake_up", self.wake_up), web.get("/is_sleeping", self.is_sleeping),
            web.post("/v1/load_lora_adapter", self.load_lora_adapter),
            web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
            web.get("/openapi.json", openapi.handler(openapi.engine_document))])

    @property
    def is_ready(self) -> bool:
        return self.serving is not None and not self.draining and self.dead is None

    @property
    def dead(self) -> str | None:
        """Why the engine died (its loop raised), or None while it lives."""
        return None if self.engine is None or self.engine.dead is None else str(self.engine.dead)

    async def load(self) -> None:
        """Build the engine (weights + KV cache) and warm it up off the event loop."""
        with startup.timing(self.startup):  # the worker threads count their phases on it
            t0 = time.perf_counter()
            log.info("dtype: %s", self.config.dtype_reason)
            core = await self.torch_thread.run(LLMEngine, self.config)  # weights_read, quantize, kv_alloc
            loaded = time.perf_counter() - t0
            self.metrics.model_load_seconds.set(loaded)
            log.info("loaded %s and allocated the KV cache (%s) in %.2fs", self.config.model,
                     _describe_cache(core), loaded)
            if self.config.speculative is not None:
                spec = self.config.speculative
                log.info("speculative decoding: %s, %s", "n-gram lookup" if spec.method == "ngram" else
                         f"draft model {spec.model}", spec)
            with startup.phase("warmup"):
                await self.torch_thread.run(_warm_up, core)
        log.info("warm-up generation took %.2fs", self.startup.seconds["warmup"])
        self.engine = AsyncEngine(core, self.metrics, self.max_queue, self.max_queued_tokens, self.fault_step,
                                  self.torch_thread)
        self.engine.start()
        self.serving = OpenAIServing(self.engine, self.model_name, self.tool_call_parser, self.sampling_defaults,
                                     self.write_timeout)
        self.responses_api = ResponsesServing(self.serving)
        phases = self.startup.ready()
        self.metrics.record_startup(phases)
        log.info("ready: serving %r (max_model_len=%d); cold start: %s", self.model_name,
                 core.config.max_model_len, startup.describe(phases))

    async def drain(self, timeout: float) -> bool:
        """Stop admitting and wait for in-flight requests; False if the timeout cut some off."""
        self.draining = True
        log.info("draining %d in-flight request(s), up to %.0fs", self.in_flight, timeout)
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d request(s) still in flight are cut off", self.in_flight)
            return False

    # ---- middlewares ----

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except EngineDeadError as e:  # on every route that reaches the engine, whenever it died
            return web.json_response(APIError(503, str(e), type_="server_error", code="engine_dead").body(),
                                     status=503)
        except APIError as e:
            retry = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
            return web.json_response(e.body(), status=e.status, headers=retry)
        except web.HTTPException as e:  # unknown route, wrong method
            if e.status < 400:
                raise
            err = APIError(e.status, f"{request.method} {request.path}: {e.reason}", type_="invalid_request_error")
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # keep 405's hint
            return web.json_response(err.body(), status=e.status, headers=allow)
        except RequestPayloadError as e:  # a body aiohttp could not decode (corrupt gzip, bad chunks): was a 500
            return web.json_response(APIError(400, unreadable_body(e)).body(), status=400)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return web.json_response(APIError(500, "internal server error", type_="server_error").body(),
                                     status=500)

    @web.middleware
    async def _admission(self, request: web.Request, handler) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if not self.is_ready:
            why = "the server is draining" if self.draining else "the model is still loading"
            raise APIError(503, f"{why}; not accepting requests", type_="server_error", code="not_ready")
        self.in_flight += 1
        self.idle.clear()
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    # ---- routes ----

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 503 once the engine died, so the kubelet restarts the pod."""
        if self.dead is not None:
            return web.json_response({"status": "dead", "error": self.dead}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        state = "ready" if self.is_ready else "dead" if self.dead else "draining" if self.draining else "loading"
        return web.json_response({"status": state}, status=200 if self.is_ready else 503)

    async def metrics_(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        """One card of /v1/models by its id (OpenAI's models.retrieve); an id may hold slashes."""
        cards = self._model_cards()
        wanted = request.match_info["model"]
        for card in cards:
            if card["id"] == wanted:
                return web.json_response(card)
        raise model_not_found(wanted, [card["id"] for card in cards])

    def _model_cards(self) -> list[dict]:
        if self.dead is not None:  # a client or router listing models would pick a replica that answers nothing
            raise EngineDeadError(self.dead)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kiln"}
        if self.serving is not None:
            card["max_model_len"] = self.serving.max_model_len
            card["dtype"] = str(self.config.torch_dtype).removeprefix("torch.")  # what --dtype auto chose
        return lora_serving.model_cards(self.engine, self.model_name, card)  # and the LoRA adapters

    # A standby replica (warm pool) sleeps: its KV cache is released until it is woken, by
    # POST /wake_up or implicitly by its first request. The names are vLLM's sleep-mode endpoints.

    async def sleep(self, request: web.Request) -> web.Response:
        try:
            took = await self._timed(self.engine.engine.sleep)
        except ValueError as e:
            raise APIError(409, str(e), type_="invalid_request_error", code="busy") from None
        log.info("sleeping: KV cache released in %.3fs", took)
        return web.json_response({"is_sleeping": True, "seconds": round(took, 4)})

    async def wake_up(self, request: web.Request) -> web.Response:
        took = await self._timed(self.engine.engine.wake_up)
        log.info("awake: KV cache allocated in %.3fs", took)
        return web.json_response({"is_sleeping": False, "seconds": round(took, 4)})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        if self.engine is None:
            raise APIError(503, "the model is still loading", type_="server_error", code="not_ready")
        if self.dead is not None:  # neither asleep nor awake: gone
            raise EngineDeadError(self.dead)
        return web.json_response({"is_sleeping": self.engine.engine.is_sleeping})

    async def _timed(self, fn) -> float:
        started = time.perf_counter()
        await self.engine.call(fn)
        return time.perf_counter() - started

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serving.completions(request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serving.chat(request)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self.responses_api.create(request)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self.serving.tokenize(request)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await lora_serving.load_lora_adapter(self.engine, self.model_name, request)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await lora_serving.unload_lora_adapter(self.engine, request)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self.serving.detokenize(request)


def _warm_up(core: LLMEngine) -> None:
    # Two tokens: one prefill step and one decode step run every code path; more decode steps only add time.
    core.add_request("kiln-warmup", "Hello", SamplingParams(temperature=0.0, max_tokens=2))
    while core.has_unfinished_requests():
        core.step()


def _describe_cache(core: LLMEngine) -> str:
    blocks, size = core.runner.num_blocks, core.config.block_size
    dtype = str(core.runner.kv_cache.dtype).removeprefix("torch.")
    return (f"{blocks} blocks x {size} = {blocks * size} tokens ({dtype}), "
            f"{core.runner.kv_cache.nbytes / 2**20:.0f} MiB ({core.runner.kv_source})")


async def serve(args: argparse.Namespace, timer: startup.StartupTimer) -> int:
    try:
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(tool_parsers.PARSERS)})")
        model_path = resolve_model_path(args.model)  # a typo is exit 2 now, not a failed load once listening
        defaults = sampling_defaults(args.generation_config, model_path)
        if args.served_model_name is not None and not args.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty: clients name the model with it")
        name = args.served_model_name or served_name(args.model)
        api_keys = auth.api_keys(args.api_key)
        config = Config(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                        load_format=args.load_format,
                        enable_prefix_caching=not args.no_prefix_caching,
                        attention_backend=args.attention_backend, device=args.device, seed=args.seed,
                        quantization=args.quantization, quantization_cache=args.quantization_cache,
                        gguf_dequantize=args.gguf_dequantize, kv_cache_dtype=args.kv_cache_dtype,
                        tensor_parallel_size=args.tensor_parallel_size, enable_lora=args.enable_lora,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                        lora_modules=tuple(args.lora_modules),
                        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
                        speculative=SpeculativeConfig.from_json(args.speculative_config)
                        if args.speculative_config else None)
        lora_serving.check_modules(args.lora_modules, name)
        if config.speculative is not None and config.speculative.model is not None:
            try:
                resolve_model_path(config.speculative.model)
            except ValueError as e:
                raise ValueError(f"--speculative-config: the draft model: {e}") from None
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return 2
    try:
        fault_step = fault_step_from_env()
    except ValueError as e:
        log.error("bad environment: %s", e)
        return 2
    if fault_step is not None:
        log.warning("test-only fault hook: engine step %d will raise and kill the engine", fault_step)
    configure_torch_threads()  # before the engine builds its thread pool; logged
    # The engine thread (Python between its ops) and the event loop (HTTP, streaming) share the GIL,
    # which a waiting thread gets only after the switch interval (5 ms by default): a token's
    # streaming work could hold a decode step back by milliseconds. 0.5 ms bounds that wait.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if defaults:
        log.info("requests that leave them out get the model's sampling defaults (%s): %s",
                 args.generation_config, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    if config.speculative is not None and defaults.get("repetition_penalty", 1.0) != 1.0:
        log.warning("the model's repetition_penalty=%s turns speculative decoding off for every request that "
                    "leaves it out (a penalized request does not speculate); --generation-config vllm ignores it",
                    defaults["repetition_penalty"])
    server = Server(config, name, args.max_queue, timer, args.max_num_queued_tokens, fault_step, args.tool_call_parser,
                    api_keys, defaults, args.write_timeout)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    # shutdown_timeout is short because drain() already waited for in-flight requests.
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    # Before "listening": a stop from then on is ours to handle, not the default action's.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()
    try:
        for sock in listening_sockets(args.host, args.port):
            await web.SockSite(runner, sock).start()
    except OSError as e:  # the port is taken or the address is not this machine's: say so, no traceback
        log.error("cannot listen on %s:%d: %s", args.host or "*", args.port, e.strerror or e)
        await runner.cleanup()
        return 1
    port = runner.addresses[0][1] if runner.addresses else args.port  # --port 0: the one the OS gave
    log.info("listening on http://%s:%d (health at /health, readiness at /ready)", args.host or "*", port)
    loading = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        log.error("failed to start: %s", loading.exception())
        await runner.cleanup()
        return 1
    if not loading.done():
        # Stopped while the model loads on its thread, which nothing can interrupt: the interpreter
        # would abort on exit while that thread runs torch (exit 134). Nothing is served yet.
        await runner.cleanup()
        log.info("stopped while loading")
        logging.shutdown()
        os._exit(0)
    await stopping
    await server.drain(args.drain_timeout)
    await runner.cleanup()  # closes connections; a cut-off handler's abort runs here
    if server.engine is not None:
        await server.engine.stop()
    log.info("stopped")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model name, HF folder or .gguf path")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    # None: every address of both families, so a pod answers its probes on an IPv6 pod IP too.
    parser.add_argument("--host", default=None, help="address to listen on (default: all, IPv4 and IPv6)")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="auto: bfloat16 on CUDA and on CPUs with AVX512_BF16 or AMX, else float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=_positive(int), default=None)
    parser.add_argument("--max-num-seqs", type=_positive(int), default=128)
    parser.add_argument("--max-num-batched-tokens", type=_positive(int), default=2048)
    parser.add_argument("--block-size", type=_positive(int), default=16)
    add_memory_arguments(parser)
    add_quantization_arguments(parser)
    lora_serving.add_lora_arguments(parser)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"],
                        help="the engine's one backend for attention, norm and RoPE: auto = triton on CUDA, "
                             "cpu (the fused C++ attention op) on CPU where it builds, else torch (the reference)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=_positive(int), default=1,
                        help="split the model over N ranks (processes; GPUs on CUDA, NCCL; gloo on CPU)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM: n-gram lookup \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
                             '"disable_by_batch_size": N}\' or a draft model \'{"model": "<name, folder or .gguf>", '
                             '"num_speculative_tokens": 4, "quantization": "int4"}\' (requests without penalties)')
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="sampling defaults for requests: 'auto' the model's generation_config.json, 'vllm' "
                             "the API's own, or a folder's generation_config.json (vLLM's option)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (a file, or the template itself) replacing the model's")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"demand Authorization: Bearer KEY on every route but /health, /ready, /metrics and "
                             f"/openapi.json (repeat for more; also ${auth.ENV})")
    parser.add_argument("--tool-call-parser", default=None, choices=list(tool_parsers.PARSERS),
                        help='how the model writes a tool call, which tool_choice "auto" (the default with tools) '
                             "needs: hermes (Qwen2.5, Hermes), llama3_json (Llama 3.1+), mistral, "
                             "pythonic (Llama 3.2, 4)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command line: --tool-call-parser alone enables it")
    parser.add_argument("--max-queue", type=_positive(int), default=512,
                        help="requests allowed to wait for a seat in the batch (beyond --max-num-seqs); "
                             "more get 429")
    parser.add_argument("--max-num-queued-tokens", type=_positive(int), default=None,
                        help="prompt tokens allowed to wait for the engine (default: no limit); more get 429")
    parser.add_argument("--drain-timeout", type=_positive(float), default=30.0,
                        help="seconds to finish in-flight requests after SIGTERM")
    parser.add_argument("--write-timeout", type=_positive(float), default=DEFAULT_WRITE_TIMEOUT_S,
                        help="seconds a stream may wait for its client to read; then the request is aborted")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    timer = startup.StartupTimer.for_this_process()  # process_start and imports end here
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args, timer))
