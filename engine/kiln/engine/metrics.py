"""Prometheus metrics of one `kiln serve` process. Names are stable: HPA/KEDA rules and the
operator's autoscaler read them (kiln:num_requests_waiting + kiln:num_requests_running is the
scaling signal)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from kiln.engine import EngineStats

# Up to vLLM's top (7680 s): a long generation, a CPU replica or a backlog takes minutes end to end
# and in the queue, and a top of 160 s read every p99 past it as 160 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0)
# error: failed by a fatal engine error (the engine loop raised; see async_engine).
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """Every metric labelled by model_name, in a registry of its own so that two servers in
    one process (tests) never collide."""

    def __init__(self, model_name: str) -> None:
        self.registry, self.model_name = CollectorRegistry(), model_name
        r, labels = self.registry, ["model_name"]
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends, as vLLM exports them

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kiln:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kiln:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kiln:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.num_kv_cache_blocks = gauge("num_kv_cache_blocks", "Blocks in the KV-cache pool.")
        self.num_free_kv_cache_blocks = gauge(
            "num_free_kv_cache_blocks", "KV-cache blocks held by no request (equal to the pool when idle).")
        self.kv_cache_bytes = gauge("kv_cache_bytes", "Bytes allocated for the KV cache now "
                                    "(0 while asleep or after a fatal engine error).")
        self.engine_sleep_state = gauge("engine_sleep_state", "1 while the KV cache is released (POST /sleep).")
        self.model_load_seconds = gauge("model_load_seconds", "Seconds to load weights and allocate the KV cache.")
        self._startup_phase_seconds = Gauge(
            "kiln:startup_phase_seconds", "Seconds of the cold start in each phase (kiln.engine.startup); "
            "total: from the process start until ready.", ["model_name", "phase"], registry=r)
        # The engine keeps running totals (EngineStats fields); these counters follow them by increments.
        self._followed = {field: counter(field, text) for field, text in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            ("num_preemptions", "Requests preempted (KV blocks ran out) and recomputed later."),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens the model checked."),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens the model agreed with."))}
        self._seen = dict.fromkeys(self._followed, 0)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        # Engine-thread time while requests are in flight: in steps, and between them (commands,
        # metrics and waiting for the GIL the HTTP thread holds): bench/serving_path.py reads both.
        self.engine_step_seconds = counter("engine_step_seconds", "Seconds the engine thread spent in steps.")
        self.engine_gap_seconds = counter("engine_gap_seconds", "Seconds between consecutive steps "
                                          "while requests were unfinished.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to the start of the engine step that first ran the request.")
        # vLLM's vllm:lora_requests_info, which LoRA-aware gateways read: one series (only with LoRA),
        # labelled with the adapters in use, its value the time they last changed.
        self._lora_info = Gauge("kiln:lora_requests_info", "LoRA adapters of the running and waiting requests "
                                "(comma-separated labels); the value is when they last changed.",
                                ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                                registry=r)
        self._lora_seen: tuple | None = None
        success = Counter("kiln:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}

    def record_engine_stats(self, stats: EngineStats) -> None:
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_running.set(stats.num_running)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_kv_cache_blocks.set(stats.num_kv_blocks)
        self.num_free_kv_cache_blocks.set(stats.num_free_kv_blocks)
        self.kv_cache_bytes.set(stats.kv_cache_bytes)
        self.engine_sleep_state.set(int(stats.is_sleeping))
        if stats.lora_adapters is not None and stats.lora_adapters != self._lora_seen:
            self._lora_seen = stats.lora_adapters
            running, waiting = stats.lora_adapters
            self._lora_info.clear()
            self._lora_info.labels(self.model_name, str(stats.max_loras), ",".join(running),
                                   ",".join(waiting)).set_to_current_time()
        for field, followed in self._followed.items():
            total = getattr(stats, field)
            followed.inc(max(total - self._seen[field], 0))
            self._seen[field] = total

    def record_startup(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self._startup_phase_seconds.labels(self.model_name, phase).set(value)

    def record_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, e2e: float) -> None:
        self.request_success[reason].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.e2e_request_latency.observe(e2e)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
