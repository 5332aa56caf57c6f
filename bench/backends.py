"""Where the benchmark's replicas come from: simulators (`sim`, the default) or real vLLM-CPU engines (`vllm-cpu`).

The harness (bench/runner.py) asks a backend three things, the same for every system in front of the pool:
  * `prepare(sc, policy_data)`: make the pool exist and put its addresses in the policy (a simulator pool is
    started by the Stack itself; real engines are started here, once per engine configuration, and reused by
    every system of a scenario);
  * `state(session, addr)`: the replica's state in the simulator's `/sim/state` shape (running, waiting,
    kv_usage, counters), which the scenarios' metrics read;
  * `fault(idx, fault, value)`: a scenario's fault.

What a real engine can and cannot tell (`VllmBackend.state`, from each engine's own /metrics):
  running, waiting              vllm:num_requests_running / _waiting
  kv_usage                      vllm:kv_cache_usage_perc
  preemptions                   vllm:num_preemptions_total
  prompt / generation tokens    vllm:prompt_tokens_total / vllm:generation_tokens_total
  prefix_cache_queries / _hits  vllm:prefix_cache_queries_total / _hits_total (tokens)
  finished                      vllm:request_success_total{finished_reason}; aborted requests are not counted by
                                vLLM (an abort is inferred by nothing here: `aborted` stays None)
  http_requests                 http_requests_total{handler="/v1/chat/completions" or "/v1/completions"}: every
                                request the API server answered, those whose client left included (a client that
                                disconnects after 1 ms or 0.3 s, streaming or not, adds one, status 2xx; vLLM
                                0.32, checked by hand on this machine), so requests that reached an engine =
                                http_requests + running + waiting (`RunData.replica_requests_total`)
  ghost_tokens, late_tokens     NOT measurable: the engine does not know its client left. P4 counts ghost tokens on
                                a real engine as generated tokens - tokens the clients read + tokens read after a
                                deadline (`real_ghost_tokens`, the clients' view)
  which replica served a request: NOT in the response (no x-sim-replica); P8 counts the requests that reached each
                                engine after a time from its samples (`RunData.received_after`: http_requests +
                                running + waiting)
Counters are cumulative over an engine's life; the backend subtracts their values at the start of each run.

Faults on real engines, by process control (bench/vllm_cpu.py):
  slow X    `DutyCycle(1 / X)` on the engine's EngineCore processes (its API server keeps answering /health and
            /metrics at once, like a GPU that slowed down); X = 1 ends it
  crash     SIGKILL of the engine's process group; `recover` starts it again (40 s or more: only scenarios with
            room for that restart can use it)
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.capacity import LOAD_SCALE
from bench.scenarios.base import MODEL, Scenario, set_text_scale

REAL_SCENARIOS = ("P3", "P4", "P5", "P7", "P8", "P9", "PX")  # fit two small engines; `make bench-real`


def parse_metrics(text: str) -> dict[str, Any]:
    """A vLLM /metrics page -> the numbers the harness samples (summed over label sets)."""
    vals: dict[str, float] = {}
    finished: dict[str, float] = {}
    http_requests = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        vals[name] = vals.get(name, 0.0) + value
        if name == "vllm:request_success_total":
            m = re.search(r'finished_reason="([^"]*)"', rest)
            if m:
                finished[m.group(1)] = finished.get(m.group(1), 0.0) + value
        elif name == "http_requests_total" and re.search(r'handler="/v1/(?:chat/)?completions"', rest):
            http_requests += value
    return {"running": vals.get("vllm:num_requests_running", 0.0),
            "waiting": vals.get("vllm:num_requests_waiting", 0.0),
            "kv_usage": vals.get("vllm:kv_cache_usage_perc", 0.0),
            "counters": {"preemptions": vals.get("vllm:num_preemptions_total", 0.0),
                         "prompt_tokens": vals.get("vllm:prompt_tokens_total", 0.0),
                         "generation_tokens": vals.get("vllm:generation_tokens_total", 0.0),
                         "prefix_cache_queries": vals.get("vllm:prefix_cache_queries_total", 0.0),
                         "prefix_cache_hits": vals.get("vllm:prefix_cache_hits_total", 0.0),
                         "http_requests": http_requests,
                         "finished": finished}}


def minus(now: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Counters of `now` since `base` (gauges as they are)."""
    c0, c1 = base.get("counters", {}), now.get("counters", {})
    out = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1 if k != "finished"}
    f0 = c0.get("finished", {})
    out["finished"] = {k: v - f0.get(k, 0.0) for k, v in c1.get("finished", {}).items()}
    return {**now, "counters": out}


class SimBackend:
    """Simulated replicas: the Stack starts them (`simulator.enabled`); state and faults on their admin port."""

    name = "sim"
    real = False
    pool_size: int | None = None  # the scenario's own replica count

    def __init__(self, speed: float = LOAD_SCALE) -> None:
        self.stack: Any = None
        self.speed = speed  # the simulated hardware's speed relative to the preset's (`sluice sim --speed`)

    def supports(self, sc: Scenario) -> bool:
        return True

    def prepare(self, sc: Scenario, data: dict[str, Any]) -> None:
        """With a rig file (SLUICE_BENCH_RIG) the replicas run at the rig's speed, `--speed load_scale`: the
        scenarios' loads are scaled to what the rig's real engines deliver side by side (bench/capacity.py), and
        the simulated replicas stand in for those engines, so both sides of make bench-real's comparison carry
        the same share of their engines' capacity. Without a rig file the speed is 1 and nothing is added."""
        if self.speed != 1.0:
            sim = data["simulator"]
            sim["extra_args"] = [*sim.get("extra_args", []), "--speed", f"{self.speed:g}"]

    def attach(self, stack: Any) -> None:
        self.stack = stack

    async def begin_run(self, session: aiohttp.ClientSession, replicas: list[str]) -> dict[str, float]:
        """Get the replicas ready for one system's run; what it measured on them (`VllmBackend`: each engine's
        speed) or nothing."""
        return {}

    async def state(self, session: aiohttp.ClientSession, addr: str, timeout: float = 1.0) -> dict[str, Any]:
        async with session.get(self.stack.sim_admin_url(addr) + "/sim/state",
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return await resp.json()

    async def fault(self, session: aiohttp.ClientSession, idx: int, addr: str, fault: str, value: Any) -> bool:
        payload: dict[str, Any] = {"fault": fault}
        if value is not None:
            payload["value"] = value
        async with session.post(self.stack.sim_admin_url(addr) + "/sim/fault", json=payload,
                                timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()
            return resp.status == 200

    def end_run(self) -> None:
        return None

    def close(self) -> None:
        return None


def engine_args(sc: Scenario) -> tuple[int | None, int | None]:
    """(KV blocks, max_num_seqs) a scenario's simulator flags ask for, for the real engine's flags."""
    blocks = seqs = None
    args = list(sc.sim_args)
    for i, a in enumerate(args[:-1]):
        if a == "--num-gpu-blocks":
            blocks = int(args[i + 1])
        if a == "--max-num-seqs":
            seqs = int(args[i + 1])
    return blocks, seqs


# Prompt tokens of one warm-up batch: the scenarios' shapes, up to P3's long prompt (16,000 on an AVX-512 CPU).
WARM_UP_PROMPTS = (500, 800, 1000, 300, 600, 900, 2000, 6000, 16000)
WARM_UP_ROUNDS = 2
PROBE_TOKENS = 4000  # the engine-speed probe before each system's run (`VllmBackend._probe`): two prefill chunks
WARM_UP_HEADROOM = 256  # tokens kept free of a warm-up prompt in the context: the chat template and the reply


def warm_up_prompts(context: int) -> tuple[int, ...]:
    """The warm-up shapes an engine of `context` tokens per sequence can serve."""
    return tuple(n for n in WARM_UP_PROMPTS if n + WARM_UP_HEADROOM <= context)


class VllmBackend:
    """Two real vLLM-CPU engines (one per core, bench/vllm_cpu.py), kept across the systems of a scenario and
    restarted only when a scenario asks for another engine configuration."""

    name = "vllm-cpu"
    real = True
    pool_size = 2  # one engine per core of this machine; every scenario runs on this pool

    def __init__(self, log_dir: Path, vllm_venv: str | None = None) -> None:
        from bench import vllm_cpu

        if vllm_venv:
            vllm_cpu.VENV = Path(vllm_venv)
        self.vc = vllm_cpu
        self.log_dir = log_dir
        self.engines: list[Any] = []
        self.config: tuple[Any, ...] | None = None
        self.base: dict[str, dict[str, Any]] = {}
        self.duty: dict[int, Any] = {}
        self.text_scale = 1.0
        self.context = vllm_cpu.MAX_POSITIONS  # tokens the engines hold per sequence: their max_model_len
        self._probes = 0  # speed probes sent: each one seeds its own random prompt

    def supports(self, sc: Scenario) -> bool:
        return sc.id in REAL_SCENARIOS

    def _start(self, blocks: int | None, seqs: int | None) -> None:
        from extproc.supervisor import free_ports

        self.close()
        extra: list[str] = ["--served-model-name", MODEL]
        # P9's 97 blocks hold less than the model's positions, and vLLM refuses a context its KV cannot hold
        self.context = self.vc.context_for_blocks(blocks) if blocks else self.vc.MAX_POSITIONS
        kw: dict[str, Any] = {"max_model_len": self.context}
        if blocks:
            extra += ["--num-gpu-blocks-override", str(blocks)]
        kw["extra_args"] = tuple(extra)
        if seqs:
            kw["max_num_seqs"] = seqs
        specs = self.vc.engine_specs(free_ports(self.pool_size), **kw)
        self.engines = self.vc.start_engines(specs, self.log_dir, dev_mode=True)
        self.text_scale = self._measure_text_scale()
        self._warm_up()
        print(f"  vllm-cpu engines ready: {[e.url for e in self.engines]} (KV blocks {blocks or 'default'}, "
              f"{self.text_scale:.3f} words per simulator token)", flush=True)

    def _warm_up(self) -> None:
        """Serve WARM_UP_ROUNDS rounds of a mixed batch on every engine before any system runs: a fresh vLLM-CPU
        engine takes ~1 s over its first requests of each shape, and the first system of a scenario (sluice)
        paid it alone (its short requests of the first second: TTFT 0.6-1.1 s, the next system's 0.02-0.1 s on the
        same engines). Its prefix cache is emptied before each run (`begin_run`). A shape longer than the engines'
        context is left out: vLLM answers it 400 (P9's engines hold 12,288 tokens, the longest shape is 16,000)."""
        from concurrent.futures import ThreadPoolExecutor

        from bench.scenarios.base import chat

        set_text_scale(self.text_scale)
        bodies = [chat(n, 8, salt=8_000_000 + i, stream=False) for i, n in enumerate(warm_up_prompts(self.context))]
        jobs = [(e.url, b) for _ in range(WARM_UP_ROUNDS) for e in self.engines for b in bodies]
        with ThreadPoolExecutor(max_workers=len(bodies) * len(self.engines)) as pool:
            list(pool.map(lambda job: self._post(*job), jobs))

    @staticmethod
    def _post(url: str, body: dict[str, Any]) -> None:
        import json

        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()

    def _measure_text_scale(self) -> float:
        """Words of the harness's filler text per token of the real tokenizer, so a prompt of N tokens in a
        scenario is N real tokens: one probe request of 2,000 simulator tokens, its usage.prompt_tokens."""
        import json

        from bench.scenarios.base import chat

        set_text_scale(1.0)
        body = chat(2000, 1, salt=1, stream=False)
        req = urllib.request.Request(self.engines[0].url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            used = json.loads(resp.read())["usage"]["prompt_tokens"]
        return 2000.0 / float(used)

    def prepare(self, sc: Scenario, data: dict[str, Any]) -> None:
        blocks, seqs = engine_args(sc)
        config = (blocks, seqs)
        if config != self.config or not all(e.alive() for e in self.engines):
            self._start(blocks, seqs)
            self.config = config
        set_text_scale(self.text_scale)
        data["pools"][0]["replicas"] = [f"127.0.0.1:{e.spec.port}" for e in self.engines]
        data["simulator"]["enabled"] = False

    def attach(self, stack: Any) -> None:
        return None

    def _url(self, addr: str) -> str:
        return f"http://{addr}"

    async def _raw(self, session: aiohttp.ClientSession, addr: str, timeout: float) -> dict[str, Any]:
        async with session.get(self._url(addr) + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return parse_metrics(await resp.text())

    async def begin_run(self, session: aiohttp.ClientSession, replicas: list[str]) -> dict[str, float]:
        """Wait (bounded) for idle engines, time one prefill on each (`_probe`), drop their prefix caches, and take
        the counters' starting values. Returns the probes' seconds per replica."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = [await self._raw(session, a, 5) for a in replicas]
            if all(s["running"] + s["waiting"] == 0 for s in states):
                break
            await asyncio.sleep(0.5)
        probes = {a: await self._probe(session, a) for a in replicas}
        for a in replicas:
            try:
                async with session.post(self._url(a) + "/reset_prefix_cache",
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    await resp.read()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
            self.base[a] = await self._raw(session, a, 5)
        return probes

    async def _probe(self, session: aiohttp.ClientSession, addr: str) -> float:
        """One idle engine's TTFT for a PROBE_TOKENS-token prompt of random token ids, measured as the calibration
        measures its `ttft_4000` row (`extproc.sim.measure.LiveEngine`).

        The systems of a scenario run one after another on the same engines, and this shared machine's engines
        change speed within minutes (on an Intel Xeon the same 4,000-token prompt took 0.19 s and 0.29 s a minute
        apart): the probe before each run shows whether two systems were compared at the same engine speed."""
        from extproc.sim.measure import LiveEngine

        self._probes += 1
        engine = LiveEngine(self._url(addr), session, model=MODEL, vocab=self.vc.VOCAB, seed=self._probes)
        return round((await engine.stream(engine.prompt(PROBE_TOKENS), 1)).ttft, 4)

    async def state(self, session: aiohttp.ClientSession, addr: str, timeout: float = 1.0) -> dict[str, Any]:
        now = await self._raw(session, addr, max(timeout, 2.0))
        return minus(now, self.base.get(addr, {}))

    async def fault(self, session: aiohttp.ClientSession, idx: int, addr: str, fault: str, value: Any) -> bool:
        engine = self.engines[idx]
        if fault == "slow":
            old = self.duty.pop(idx, None)
            if old is not None:
                await asyncio.to_thread(old.stop)
            factor = float(value or 1.0)
            if factor > 1.0:
                self.duty[idx] = self.vc.DutyCycle(engine, 1.0 / factor).start()
            return True
        if fault == "crash":
            import signal

            engine.signal_group(signal.SIGKILL)
            return True
        if fault == "recover":
            await asyncio.to_thread(self._restart, idx)
            return True
        return False

    def _restart(self, idx: int) -> None:
        old = self.engines[idx]
        old.stop()
        [new] = self.vc.start_engines([old.spec], self.log_dir, dev_mode=True)
        self.engines[idx] = new

    def end_run(self) -> None:
        for d in self.duty.values():
            d.stop()
        self.duty.clear()

    def close(self) -> None:
        self.end_run()
        if self.engines:
            self.vc.stop_engines(self.engines)
        self.engines = []
        self.config = None
        set_text_scale(1.0)


def make_backend(name: str, log_dir: Path, vllm_venv: str | None = None) -> SimBackend | VllmBackend:
    if name == "sim":
        return SimBackend()
    if name == "vllm-cpu":
        return VllmBackend(log_dir, vllm_venv)
    raise ValueError(f"unknown backend {name!r} (sim, vllm-cpu)")


__all__ = ["SimBackend", "VllmBackend", "make_backend", "parse_metrics", "REAL_SCENARIOS"]
