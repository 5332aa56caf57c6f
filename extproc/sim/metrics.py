"""Prometheus exposition of one simulated replica, with vLLM 0.32's (or SGLang's) exact names.

A custom collector reads the engine's counters at scrape time, so the hot path never touches
prometheus-client objects. Each app has its own ``CollectorRegistry``, so several simulators can
live in one process (tests, the benchmark harness). Counter families are declared without
``_total``; prometheus-client appends it, giving e.g. ``vllm:prompt_tokens_total``.

Times are wall seconds as a client observes them (simulated seconds / time_scale).
Both styles also export ``sim_ghost_tokens_total``: tokens generated for requests whose client
had already disconnected (only non-zero with the no-abort fault, or between a disconnect and
the abort reaching the engine).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .engine import Engine, Histogram

__all__ = ["SimCollector", "make_registry", "render", "CONTENT_TYPE", "VLLM_NAMES", "SGLANG_NAMES"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The single place where metric names live (vLLM 0.32, V1 engine).
VLLM_NAMES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "prefix_queries": "vllm:prefix_cache_queries",  # + _total
    "prefix_hits": "vllm:prefix_cache_hits",  # + _total
    "preemptions": "vllm:num_preemptions",  # + _total
    "prompt_tokens": "vllm:prompt_tokens",  # + _total
    "generation_tokens": "vllm:generation_tokens",  # + _total
    "success": "vllm:request_success",  # + _total
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "prefill_time": "vllm:request_prefill_time_seconds",
    "prefill_computed": "vllm:request_prefill_kv_computed_tokens",
}
SGLANG_NAMES = {
    "running": "sglang:num_running_reqs",
    "waiting": "sglang:num_queue_reqs",
    "kv_usage": "sglang:token_usage",
    "cache_hit_rate": "sglang:cache_hit_rate",
    "ttft": "sglang:time_to_first_token_seconds",
    "itl": "sglang:inter_token_latency_seconds",
    "e2e": "sglang:e2e_request_latency_seconds",
    "prompt_tokens": "sglang:prompt_tokens",  # + _total
    "generation_tokens": "sglang:generation_tokens",  # + _total
}
GHOST = "sim_ghost_tokens"  # + _total


def _hist(name: str, doc: str, labels: list[str], values: list[str], h: Histogram) -> Metric:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    buckets = [(repr(float(b)), c) for b, c in h.cumulative()]
    buckets.append(("+Inf", h.count))
    fam.add_metric(values, buckets, h.sum)
    return fam


class SimCollector(Collector):
    """Yields the metric families of one engine at scrape time."""

    def __init__(self, engine_ref: Callable[[], Engine], model_name: str, style: str = "vllm",
                 engine_label: str = "0", now_ref: Callable[[], float] | None = None) -> None:
        if style not in ("vllm", "sglang"):
            raise ValueError(f"unknown metrics style {style!r}")
        self._engine = engine_ref
        self.model_name = model_name
        self.style = style
        self.engine_label = engine_label
        self.lagging_running = 0  # aborted requests the running gauge still shows (CostModel.abort)
        self._now = now_ref       # the engine's time now (None: its clock), for the waiting gauge

    def _waiting(self, eng: Engine) -> int:
        return eng.waiting_in_engine(self._now() if self._now is not None else None)

    def collect(self) -> Iterator[Metric]:
        eng = self._engine()
        if self.style == "sglang":
            yield from self._sglang(eng)
        else:
            yield from self._vllm(eng)
        labels, values = self._labels()
        g = CounterMetricFamily(GHOST, "Tokens generated for requests whose client had gone.",
                                labels=labels)
        g.add_metric(values, eng.stats.ghost_tokens)
        yield g

    def _labels(self) -> tuple[list[str], list[str]]:
        if self.style == "sglang":
            return ["model_name"], [self.model_name]
        return ["model_name", "engine"], [self.model_name, self.engine_label]

    def _vllm(self, eng: Engine) -> Iterator[Metric]:
        n = VLLM_NAMES
        st = eng.stats
        labels, values = self._labels()

        def gauge(key: str, doc: str, v: float) -> Metric:
            f = GaugeMetricFamily(n[key], doc, labels=labels)
            f.add_metric(values, v)
            return f

        def counter(key: str, doc: str, v: float) -> Metric:
            f = CounterMetricFamily(n[key], doc, labels=labels)
            f.add_metric(values, v)
            return f

        # Like vLLM: the cache configuration as an info-style gauge; gateways read the KV capacity from it.
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*labels, "block_size", "num_gpu_blocks"])
        info.add_metric([*values, str(eng.block_size), str(eng.num_gpu_blocks)], 1.0)
        yield info
        yield gauge("running", "Number of requests in model execution batches.",
                    len(eng.running) + self.lagging_running)
        yield gauge("waiting", "Number of requests waiting to be processed.", self._waiting(eng))
        yield gauge("kv_usage", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage())
        yield counter("prefix_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      st.prefix_queries)
        yield counter("prefix_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      st.prefix_hits)
        yield counter("preemptions", "Cumulative number of preemption from the engine.", st.preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        succ = CounterMetricFamily(n["success"], "Count of successfully processed requests.",
                                   labels=labels + ["finished_reason"])
        for reason in sorted(st.finished):
            succ.add_metric(values + [reason], st.finished[reason])
        yield succ
        yield _hist(n["ttft"], "Histogram of time to first token in seconds.", labels, values, st.ttft)
        yield _hist(n["itl"], "Histogram of inter-token latency in seconds.", labels, values, st.itl)
        yield _hist(n["queue"], "Histogram of time spent in WAITING phase for request.", labels, values,
                    st.queue)
        yield _hist(n["e2e"], "Histogram of e2e request latency in seconds.", labels, values, st.e2e)
        yield _hist(n["prefill_time"], "Histogram of time spent in PREFILL phase for request.", labels, values,
                    st.prefill_time)
        yield _hist(n["prefill_computed"], "Histogram of new KV tokens computed during prefill (excluding cached "
                    "tokens).", labels, values, st.prefill_computed)

    def _sglang(self, eng: Engine) -> Iterator[Metric]:
        n = SGLANG_NAMES
        st = eng.stats
        labels, values = self._labels()
        for key, doc, v in (
            ("running", "The number of running requests.", len(eng.running)),
            ("waiting", "The number of requests in the waiting queue.", self._waiting(eng)),
            ("kv_usage", "The token usage.", eng.kv_usage()),
            ("cache_hit_rate", "The prefix cache hit rate.",
             st.prefix_hits / st.prefix_queries if st.prefix_queries else 0.0),
        ):
            f = GaugeMetricFamily(n[key], doc, labels=labels)
            f.add_metric(values, v)
            yield f
        for key, doc, v in (
            ("prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.", st.generation_tokens),
        ):
            f = CounterMetricFamily(n[key], doc, labels=labels)
            f.add_metric(values, v)
            yield f
        yield _hist(n["ttft"], "Histogram of time to first token in seconds.", labels, values, st.ttft)
        yield _hist(n["itl"], "Histogram of inter-token latency in seconds.", labels, values, st.itl)
        yield _hist(n["e2e"], "Histogram of End-to-end request latency in seconds", labels, values, st.e2e)


def make_registry(collector: SimCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
