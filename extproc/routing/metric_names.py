"""Which engine metric feeds which `EngineState` field: the ONE place where vLLM / SGLang metric names live.

Metric names change between engine releases; add the new spelling here (in order of preference) and nothing
else moves. Each field lists the exposition SAMPLE names it may come from (counters with their `_total`
suffix, as prometheus-client writes them); when several are present in one page the first listed wins (vLLM
0.10-0.11 exported both `vllm:kv_cache_usage_perc` and the deprecated `vllm:gpu_cache_usage_perc`).

Samples of one metric that differ only in labels (`engine="0"`, `engine="1"` with data parallelism,
`model_name` with LoRA adapters) are combined: gauges and counters summed, except fractions (KV usage, cache
hit rate) which are averaged; histogram buckets summed per `le`.

| EngineState field      | vLLM (0.32, V1 engine)                                  | SGLang                          |
|------------------------|---------------------------------------------------------|---------------------------------|
| running                | vllm:num_requests_running                               | sglang:num_running_reqs         |
| waiting                | vllm:num_requests_waiting                               | sglang:num_queue_reqs           |
| kv_usage (0..1)        | vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc     | sglang:token_usage              |
| preemptions_total      | vllm:num_preemptions_total                              | -                               |
| kv_capacity_tokens     | vllm:cache_config_info{block_size} x {num_gpu_blocks}   | sglang:max_total_num_tokens     |
| ttft_p95_s, count      | vllm:time_to_first_token_seconds (histogram deltas)     | sglang:time_to_first_token_seconds |
| generation_tps         | vllm:generation_tokens_total (counter delta / window)   | sglang:generation_tokens_total, else the sglang:gen_throughput gauge |
| prompt_tps             | vllm:prompt_tokens_total (counter delta / window)       | sglang:prompt_tokens_total      |
| errors_total           | vllm:request_success_total{finished_reason=error|abort} | -                               |
| prefix_hit_rate (ext.) | vllm:prefix_cache_hits_total / _queries_total (deltas)  | sglang:cache_hit_rate           |
| itl_s (ext.)           | vllm:inter_token_latency_seconds _sum / _count (deltas) | sglang:inter_token_latency_seconds |
| prefill_seconds_total, prefilled_requests_total (ext.) | vllm:request_prefill_time_seconds _sum, _count | -     |
| prefill_computed_total (ext.) | vllm:request_prefill_kv_computed_tokens _sum     | -                               |
"""

from __future__ import annotations

from dataclasses import dataclass

# Kinds of sample the parser understands.
GAUGE = 0         # summed over label sets
FRACTION = 1      # averaged over label sets (a 0..1 ratio per engine)
COUNTER = 2       # summed; windowed rates come from deltas
HIST_BUCKET = 3   # <hist>_bucket{le=...}: summed per le
HIST_COUNT = 4    # <hist>_count (the +Inf bucket says the same; used when buckets are missing)
HIST_STAT = 7     # <hist>_sum or <hist>_count of a histogram read only for its mean (summed like a counter)
OUTCOMES = 5      # counter with a finished_reason label
CACHE_INFO = 6    # info gauge whose labels carry block_size and num_gpu_blocks


@dataclass(frozen=True, slots=True)
class MetricNames:
    """The metric names of one engine family. Tuple fields: sample names in order of preference."""

    style: str
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]                 # a 0..1 fraction
    preemptions: tuple[str, ...] = ()
    generation_tokens: tuple[str, ...] = ()   # counter
    prompt_tokens: tuple[str, ...] = ()       # counter
    generation_tps_gauge: tuple[str, ...] = ()  # used only when no generation counter is exported
    ttft: tuple[str, ...] = ()                # histogram family names (without _bucket / _count)
    request_outcomes: tuple[str, ...] = ()    # counter labelled finished_reason
    error_reasons: tuple[str, ...] = ()       # finished_reason values counted into errors_total
    cache_config_info: tuple[str, ...] = ()   # labels block_size, num_gpu_blocks
    kv_capacity_tokens: tuple[str, ...] = ()  # a gauge that is already the KV capacity in tokens
    prefix_queries: tuple[str, ...] = ()      # counter (tokens)
    prefix_hits: tuple[str, ...] = ()         # counter (tokens)
    cache_hit_rate: tuple[str, ...] = ()      # a 0..1 gauge (SGLang)
    itl: tuple[str, ...] = ()                 # inter-token latency histogram (family names): its mean only
    # per finished request: seconds from its first scheduling to its first token, and the prompt tokens it computed
    # (histogram family names; their _sum and _count only)
    prefill_time: tuple[str, ...] = ()
    prefill_computed: tuple[str, ...] = ()

    def samples(self) -> dict[str, tuple[int, str, int]]:
        """sample name -> (kind, field, preference); what the line scanner dispatches on."""
        out: dict[str, tuple[int, str, int]] = {}

        def add(names: tuple[str, ...], kind: int, fld: str, suffix: str = "") -> None:
            for prio, name in enumerate(names):
                out.setdefault(name + suffix, (kind, fld, prio))

        add(self.running, GAUGE, "running")
        add(self.waiting, GAUGE, "waiting")
        add(self.kv_usage, FRACTION, "kv_usage")
        add(self.preemptions, COUNTER, "preemptions")
        add(self.generation_tokens, COUNTER, "generation_tokens")
        add(self.prompt_tokens, COUNTER, "prompt_tokens")
        add(self.generation_tps_gauge, GAUGE, "generation_tps_gauge")
        add(self.ttft, HIST_BUCKET, "ttft", "_bucket")
        add(self.ttft, HIST_COUNT, "ttft", "_count")
        add(self.request_outcomes, OUTCOMES, "outcomes")
        add(self.cache_config_info, CACHE_INFO, "cache_info")
        add(self.kv_capacity_tokens, GAUGE, "kv_capacity_tokens")
        add(self.prefix_queries, COUNTER, "prefix_queries")
        add(self.prefix_hits, COUNTER, "prefix_hits")
        add(self.cache_hit_rate, FRACTION, "cache_hit_rate")
        add(self.itl, HIST_STAT, "itl_sum", "_sum")
        add(self.itl, HIST_STAT, "itl_count", "_count")
        add(self.prefill_time, HIST_STAT, "prefill_s_sum", "_sum")
        add(self.prefill_time, HIST_STAT, "prefill_s_count", "_count")
        add(self.prefill_computed, HIST_STAT, "prefill_new_sum", "_sum")
        return out


VLLM = MetricNames(
    style="vllm",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    preemptions=("vllm:num_preemptions_total",),
    generation_tokens=("vllm:generation_tokens_total",),
    prompt_tokens=("vllm:prompt_tokens_total",),
    ttft=("vllm:time_to_first_token_seconds",),
    request_outcomes=("vllm:request_success_total",),
    error_reasons=("error", "abort"),
    cache_config_info=("vllm:cache_config_info",),
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    itl=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    prefill_time=("vllm:request_prefill_time_seconds",),
    prefill_computed=("vllm:request_prefill_kv_computed_tokens",),
)

SGLANG = MetricNames(
    style="sglang",
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    generation_tokens=("sglang:generation_tokens_total",),
    prompt_tokens=("sglang:prompt_tokens_total",),
    generation_tps_gauge=("sglang:gen_throughput",),
    ttft=("sglang:time_to_first_token_seconds",),
    kv_capacity_tokens=("sglang:max_total_num_tokens",),
    cache_hit_rate=("sglang:cache_hit_rate",),
    itl=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
)

STYLES: dict[str, MetricNames] = {"vllm": VLLM, "sglang": SGLANG}


def names_for(style: str) -> MetricNames:
    """The names of a pool's `metrics_style` (vllm | sglang)."""
    try:
        return STYLES[style]
    except KeyError:
        raise ValueError(f"unknown metrics style {style!r}; known: {', '.join(STYLES)}") from None
