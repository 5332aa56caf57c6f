"""Small vLLM / SGLang /metrics pages with chosen values, in prometheus-client's text format."""

from __future__ import annotations

BOUNDS = (0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 20.0, 40.0)


def cumulative(observations: list[float], bounds: tuple[float, ...] = BOUNDS) -> list[float]:
    """Cumulative bucket counts (bounds then +Inf) of a list of observations."""
    return [float(sum(1 for x in observations if x <= b)) for b in bounds] + [float(len(observations))]


def vllm_page(running: float = 0, waiting: float = 0, kv: float = 0.0, gen: float = 0, prompt: float = 0,
              ttft: list[float] | None = None, preemptions: float = 0, bounds: tuple[float, ...] = BOUNDS,
              blocks: int | None = None, errors: float = 0, itl: tuple[float, float] | None = None,
              prefix: tuple[float, float] | None = None) -> bytes:
    """`itl`: the inter-token latency histogram's (sum, count); `prefix`: the prefix-cache (queries, hits)."""
    lab = 'engine="0",model_name="m"'
    out = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lab}}} {float(running)}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lab}}} {float(waiting)}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lab}}} {float(kv)}",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{lab}}} {float(preemptions)}",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{lab}}} {float(prompt)}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{lab}}} {float(gen)}",
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 10.0',
        f'vllm:request_success_total{{engine="0",finished_reason="error",model_name="m"}} {float(errors)}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    cum = cumulative(ttft or [], bounds)
    for b, c in zip([repr(float(b)) for b in bounds] + ["+Inf"], cum):
        out.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{b}",model_name="m"}} {c}')
    out.append(f"vllm:time_to_first_token_seconds_count{{{lab}}} {cum[-1]}")
    out.append(f"vllm:time_to_first_token_seconds_sum{{{lab}}} {float(sum(ttft or []))}")
    if blocks is not None:
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append(f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0')
    if itl is not None:
        out.append("# TYPE vllm:inter_token_latency_seconds histogram")
        out.append(f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {itl[1]}')
        out.append(f"vllm:inter_token_latency_seconds_count{{{lab}}} {float(itl[1])}")
        out.append(f"vllm:inter_token_latency_seconds_sum{{{lab}}} {float(itl[0])}")
    if prefix is not None:
        out.append("# TYPE vllm:prefix_cache_queries_total counter")
        out.append(f"vllm:prefix_cache_queries_total{{{lab}}} {float(prefix[0])}")
        out.append("# TYPE vllm:prefix_cache_hits_total counter")
        out.append(f"vllm:prefix_cache_hits_total{{{lab}}} {float(prefix[1])}")
    return ("\n".join(out) + "\n").encode()


def sglang_page(running: float = 0, waiting: float = 0, usage: float = 0.0, gen: float | None = 0,
                gen_throughput: float = 0.0, ttft: list[float] | None = None, hit_rate: float = 0.0) -> bytes:
    lab = 'model_name="m"'
    out = [
        "# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{{{lab}}} {float(running)}",
        "# TYPE sglang:num_queue_reqs gauge", f"sglang:num_queue_reqs{{{lab}}} {float(waiting)}",
        "# TYPE sglang:token_usage gauge", f"sglang:token_usage{{{lab}}} {float(usage)}",
        "# TYPE sglang:gen_throughput gauge", f"sglang:gen_throughput{{{lab}}} {float(gen_throughput)}",
        "# TYPE sglang:cache_hit_rate gauge", f"sglang:cache_hit_rate{{{lab}}} {float(hit_rate)}",
    ]
    if gen is not None:
        out += ["# TYPE sglang:generation_tokens_total counter", f"sglang:generation_tokens_total{{{lab}}} {float(gen)}"]
    out.append("# TYPE sglang:time_to_first_token_seconds histogram")
    cum = cumulative(ttft or [])
    for b, c in zip([repr(float(b)) for b in BOUNDS] + ["+Inf"], cum):
        out.append(f'sglang:time_to_first_token_seconds_bucket{{le="{b}",{lab}}} {c}')
    return ("\n".join(out) + "\n").encode()
