"""Regenerate the /metrics fixtures: `python tests/routing/data/make_fixtures.py`.

The pages are rendered by prometheus-client itself (as vLLM and SGLang do) with the engines' own metric
names, label sets and bucket layouts, so the parser is tested on the real exposition format (sorted labels,
`_created` series, `+Inf`, process/python collectors, HTTP instrumentator series). The observations are fixed,
so tests can assert exact values.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

HERE = Path(__file__).parent
MODEL = "Qwen/Qwen2.5-1.5B-Instruct"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LAT_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768]
ITER_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def vllm_page() -> bytes:
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    http = Counter("http_requests", "Total number of requests by method, status and handler.",
                   ["handler", "method", "status"], registry=reg)
    for h, s, n in (("/v1/chat/completions", "2xx", 1520), ("/metrics", "2xx", 88210), ("/health", "2xx", 4400),
                    ("/v1/chat/completions", "4xx", 3)):
        http.labels(h, "POST" if h.startswith("/v1") else "GET", s).inc(n)
    hsize = Histogram("http_request_size_bytes", "Content length of incoming requests by handler.", ["handler"],
                      registry=reg)
    hlat = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                     ["handler", "method"], registry=reg, buckets=(0.1, 0.5, 1.0))
    for i in range(50):
        hsize.labels("/v1/chat/completions").observe(800 + 10 * i)
        hlat.labels("/v1/chat/completions", "POST").observe(0.05 * i)
    L = ["model_name", "engine"]
    v = [MODEL, "0"]
    g = lambda n, d: Gauge(n, d, L, registry=reg).labels(*v)  # noqa: E731
    c = lambda n, d: Counter(n, d, L, registry=reg).labels(*v)  # noqa: E731
    h = lambda n, d, b: Histogram(n, d, L, registry=reg, buckets=b).labels(*v)  # noqa: E731
    g("vllm:num_requests_running", "Number of requests in model execution batches.").set(7)
    g("vllm:num_requests_waiting", "Number of requests waiting to be processed.").set(3)
    g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").set(0.4375)
    c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.").inc(250000)
    c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").inc(125000)
    c("vllm:num_preemptions", "Cumulative number of preemption from the engine.").inc(12)
    c("vllm:prompt_tokens", "Number of prefill tokens processed.").inc(1_234_567)
    c("vllm:generation_tokens", "Number of generation tokens processed.").inc(456_789)
    succ = Counter("vllm:request_success", "Count of successfully processed requests.",
                   L + ["finished_reason"], registry=reg)
    for reason, n in (("stop", 1400), ("length", 100), ("abort", 17), ("error", 3)):
        succ.labels(*v, reason).inc(n)
    for name, doc in (("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
                      ("vllm:request_generation_tokens", "Number of generation tokens processed."),
                      ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested "
                                                                 "generation tokens."),
                      ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),
                      ("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during "
                                                                  "prefill (excluding cached tokens).")):
        hh = h(name, doc, TOKEN_BUCKETS)
        for i in range(40):
            hh.observe(37 * i + 5)
    hn = h("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
    for _ in range(40):
        hn.observe(1)
    it = h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITER_BUCKETS)
    for i in range(200):
        it.observe((i * 53) % 3000)
    ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
    # 100 first tokens: 50 at 0.03 s, 40 at 0.07 s, 9 at 0.3 s, 1 at 12 s
    for x, n in ((0.03, 50), (0.07, 40), (0.3, 9), (12.0, 1)):
        for _ in range(n):
            ttft.observe(x)
    for name, doc, buckets in (
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. DEPRECATED.",
         ITL_BUCKETS),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LAT_BUCKETS),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LAT_BUCKETS),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
         LAT_BUCKETS),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
         LAT_BUCKETS),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LAT_BUCKETS),
    ):
        hh = h(name, doc, buckets)
        for i in range(60):
            hh.observe(0.011 * i * (3 if "e2e" in name else 1))
    info = Info("vllm:cache_config", "Information of the LLMEngine CacheConfig", registry=reg)
    info.info({"block_size": "16", "cache_dtype": "auto", "calculate_kv_scales": "False",
               "cpu_offload_gb": "0", "enable_prefix_caching": "True", "engine": "0",
               "gpu_memory_utilization": "0.9", "is_attention_free": "False", "num_cpu_blocks": "None",
               "num_gpu_blocks": "27648", "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "builtin",
               "sliding_window": "None", "swap_space": "4", "swap_space_bytes": "4294967296"})
    return generate_latest(reg)


def sglang_page() -> bytes:
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    L = ["model_name", "engine_type", "tp_rank", "pp_rank"]
    v = ["meta-llama/Llama-3.1-8B-Instruct", "unified", "0", "0"]
    g = lambda n, d: Gauge(n, d, L, registry=reg, multiprocess_mode="mostrecent").labels(*v)  # noqa: E731
    g("sglang:num_running_reqs", "The number of running requests.").set(12)
    g("sglang:num_used_tokens", "The number of used tokens.").set(48213)
    g("sglang:token_usage", "The token usage.").set(0.62)
    g("sglang:gen_throughput", "The generation throughput (token/s).").set(812.5)
    g("sglang:num_queue_reqs", "The number of requests in the waiting queue.").set(4)
    g("sglang:cache_hit_rate", "The prefix cache hit rate.").set(0.35)
    g("sglang:spec_accept_length", "The average acceptance length of speculative decoding.").set(0)
    g("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.").set(77760)
    for name, n in (("sglang:prompt_tokens", 3_456_789), ("sglang:generation_tokens", 987_654),
                    ("sglang:cached_tokens", 1_200_000), ("sglang:num_requests", 5210)):
        Counter(name, name, L, registry=reg).labels(*v).inc(n)
    ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", L,
                     registry=reg, buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200,
                                            400]).labels(*v)
    # 40 first tokens: 20 at 0.15 s, 18 at 0.5 s, 2 at 3 s
    for x, n in ((0.15, 20), (0.5, 18), (3.0, 2)):
        for _ in range(n):
            ttft.observe(x)
    for name in ("sglang:inter_token_latency_seconds", "sglang:e2e_request_latency_seconds"):
        hh = Histogram(name, name, L, registry=reg, buckets=[0.1, 0.3, 0.5, 0.7, 0.9, 1, 2, 4, 6, 8, 10, 20,
                                                              40, 60, 80, 100]).labels(*v)
        for i in range(30):
            hh.observe(0.07 * i)
    return generate_latest(reg)


if __name__ == "__main__":
    (HERE / "vllm_metrics.txt").write_bytes(vllm_page())
    (HERE / "sglang_metrics.txt").write_bytes(sglang_page())
    print("written")
