"""What every scenario is made of, and the measurement helpers they share.

A scenario (one module per problem, `bench/scenarios/pNN_*.py`) says:
  * the replica pool: how many simulated replicas, preset, `time_scale`, extra simulator flags;
  * the workload: open-loop arrivals in SCENARIO seconds, faults at scenario times, how long to run;
  * the policy knobs sluice should use (raw `admission` / `routing` / `budgets` / `tenants` sections), which the
    plain Envoy systems ignore;
  * its metrics, computed from a `RunData` (client records + replica samples + gateway samples);
  * `reproduced(metrics)`: does this system's column show the problem (asked of envoy-rr).

Time. The simulated replicas run `time_scale` times faster than the hardware they model. Scenario seconds =
wall seconds x time_scale. Every time metric a scenario reports is in scenario seconds. The gateway (Envoy,
sidecar) runs in wall time; headers sent to it carry wall seconds.
"""

from __future__ import annotations

import copy

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from bench.capacity import BENCH_PRESET
from bench.filler import FILLER_WORDS
from bench.openloop import Arrival, ClientSpec, Record

MODEL = "sim-model"


@dataclass
class Fault:
    """POST /sim/fault to replica `replica` (index in the pool) at scenario time `at`."""

    at: float
    replica: int
    fault: str
    value: Any = None


@dataclass
class Workload:
    arrivals: list[Arrival]
    duration: float                 # scenario seconds of offered load
    drain: float = 5.0              # scenario seconds after the last arrival before open requests are cancelled
    faults: list[Fault] = field(default_factory=list)
    notes: str = ""


@dataclass
class Call:
    """One user-level call as its user saw it: every attempt (SDK and business retries) from the first send.

    Its TTFT runs from the first attempt's send to the first token of the last attempt: a request shed, retried
    and then served counts with its whole latency. A call that never got a token is censored at the time its
    user waited (to its last attempt's end, or the run's deadline)."""

    attempts: list[Record]
    run_end: float

    @property
    def final(self) -> Record:
        return self.attempts[-1]

    @property
    def kind(self) -> str:
        return self.final.kind

    @property
    def group(self) -> str:
        return self.final.group

    @property
    def first_send(self) -> float:
        return self.attempts[0].first_send or self.attempts[0].start

    @property
    def ok(self) -> bool:
        return self.final.ok

    @property
    def ttft(self) -> float | None:
        """Wall seconds from the first send to the first token of the final attempt (None: no token)."""
        ft = self.final.first_token
        return None if ft is None else ft - self.first_send

    @property
    def waited(self) -> float:
        """Wall seconds from the first send to the first token, or (censored) to when the user stopped waiting."""
        if self.ttft is not None:
            return self.ttft
        end = self.final.end if self.final.end is not None else self.run_end
        return max(0.0, end - self.first_send)


def requests_received(state: dict[str, Any]) -> float:
    """Requests that reached an engine (one /sim/state-shaped reading, counters since the run began): answered, or
    still running / waiting. A simulator counts every finished request by its reason, aborts included; a real vLLM
    counts no client abort as finished (`vllm:request_success_total`), so there the answered ones are its API
    server's HTTP requests (bench/backends.py `http_requests`): finished alone read P5's retry storm, whose
    attempts mostly time out, as 0.17 requests per user on real engines."""
    c = state.get("counters") or {}
    answered = c["http_requests"] if "http_requests" in c else sum((c.get("finished") or {}).values())
    return float(answered) + float(state.get("running") or 0) + float(state.get("waiting") or 0)


@dataclass
class RunData:
    """Everything measured in one (scenario, system) run. Times: wall seconds since t0 unless said otherwise."""

    scenario: str
    system: str
    time_scale: float
    replicas: list[str]                                   # addresses, pool order
    records: list[Record] = field(default_factory=list)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # addr -> [{t, running, waiting, ...}]
    events: list[dict[str, Any]] = field(default_factory=list)            # faults injected: {t, replica, fault}
    sidecar: list[tuple[float, dict[str, list[tuple[dict[str, str], float]]]]] = field(default_factory=list)
    envoy: list[tuple[float, dict[str, list[tuple[dict[str, str], float]]]]] = field(default_factory=list)
    gateway_rss: list[tuple[float, int]] = field(default_factory=list)    # (t, Envoy + sidecar RSS bytes)
    envoy_stats: dict[str, float] = field(default_factory=dict)           # final /stats/prometheus (summed)
    sidecar_final: dict[str, float] = field(default_factory=dict)         # final sidecar /metrics (summed by name)
    sim_final: dict[str, dict[str, Any]] = field(default_factory=dict)    # addr -> final /sim/state
    extra: dict[str, Any] = field(default_factory=dict)                   # scenario-specific measurements
    duration: float = 0.0                                                 # wall seconds of offered load
    wall_s: float = 0.0

    # ---- time ------------------------------------------------------------------------------------------------
    def s(self, wall: float | None) -> float | None:
        """Wall seconds -> scenario seconds."""
        return None if wall is None else wall * self.time_scale

    # ---- records ---------------------------------------------------------------------------------------------
    def recs(self, kind: str | None = None, pred: Callable[[Record], bool] | None = None) -> list[Record]:
        return [r for r in self.records if (kind is None or r.kind == kind) and (pred is None or pred(r))]

    def ttfts(self, recs: Iterable[Record]) -> list[float]:
        """TTFT of each attempt in scenario seconds. An attempt that never got a first token (refused, failed,
        timed out, still waiting at the run's end) is censored, not dropped: it counts with the time it waited
        (to its end, or to the run's deadline), a lower bound of its TTFT. `censored(recs)` counts them."""
        end = self.extra.get("deadline", self.duration)
        out = []
        for r in recs:
            if r.ttft is not None:
                out.append(r.ttft * self.time_scale)
            else:
                out.append(((r.end if r.end is not None else end) - r.start) * self.time_scale)
        return out

    @staticmethod
    def censored(recs: Iterable[Record]) -> int:
        """Attempts without a first token (their TTFT in `ttfts` is a lower bound)."""
        return sum(1 for r in recs if r.ttft is None)

    def calls(self) -> list["Call"]:
        """The user-level calls (an arrival's call with all its SDK and business retries), in send order."""
        by_key: dict[tuple[int, int], list[Record]] = {}
        for r in self.records:
            by_key.setdefault((r.user, r.call), []).append(r)
        end = self.extra.get("deadline", self.duration)
        return sorted((Call(sorted(rs, key=lambda r: r.attempt), end) for rs in by_key.values()),
                      key=lambda c: c.first_send)

    def users(self, kind: str | None = None) -> dict[int, list[Record]]:
        out: dict[int, list[Record]] = {}
        for r in self.records:
            if kind is None or r.kind == kind:
                out.setdefault(r.user, []).append(r)
        return out

    # ---- replica samples ------------------------------------------------------------------------------------
    def series(self, addr: str, key: str) -> list[tuple[float, float]]:
        return [(x["t"], float(x[key])) for x in self.samples.get(addr, []) if x.get(key) is not None]

    def max_over_replicas(self, key: str, t_from: float | None = None, t_to: float | None = None) -> float | None:
        vals = [x[key] for ss in self.samples.values() for x in ss
                if x.get(key) is not None and (t_from is None or x["t"] >= t_from) and (t_to is None or x["t"] <= t_to)]
        return max(vals) if vals else None

    def counter_total(self, key: str) -> float:
        """Sum over replicas of a /sim/state counter at the end of the run."""
        total = 0.0
        for st in self.sim_final.values():
            v = (st.get("counters") or {}).get(key)
            if isinstance(v, (int, float)):
                total += v
        return total

    def replica_requests_total(self) -> int:
        """Requests that reached a replica's engine over the run (`requests_received`, summed at the end)."""
        return sum(int(requests_received(st)) for st in self.sim_final.values())

    def received_after(self, addr: str, t: float) -> float | None:
        """Requests that reached replica `addr` from time `t` to its last sample (`requests_received` in its
        samples; None without them). Where responses do not name their replica (real engines), this is how many
        requests a replica was sent."""
        ss = [x for x in self.samples.get(addr, []) if x.get("received") is not None]
        if not ss:
            return None
        before = [x["received"] for x in ss if x["t"] <= t]
        return ss[-1]["received"] - (before[-1] if before else 0.0)

    def time_grid(self, t_from: float, t_to: float) -> list[dict[str, dict[str, Any]]]:
        """Samples aligned by poll round: for each round, addr -> sample (rounds where every replica answered)."""
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for addr, ss in self.samples.items():
            for x in ss:
                if t_from <= x["t"] <= t_to:
                    by_round.setdefault(x["round"], {})[addr] = x
        n = len(self.samples)
        return [v for _k, v in sorted(by_round.items()) if len(v) == n]

    def first_time(self, source: str, name: str, pred: Callable[[dict[str, str], float], bool],
                   after: float = 0.0) -> float | None:
        """Wall time of the first poll of `source` ("sidecar" or "envoy") at or after `after` where some sample of
        metric `name` satisfies pred(labels, value); None if never."""
        series = self.sidecar if source == "sidecar" else self.envoy
        for t, values in series:
            if t < after:
                continue
            if any(pred(lbl, v) for lbl, v in values.get(name, [])):
                return t
        return None

    def metric_present(self, source: str, name: str) -> bool:
        series = self.sidecar if source == "sidecar" else self.envoy
        return any(values.get(name) for _t, values in series)


# ---- small numeric helpers ------------------------------------------------------------------------------------
_WORKLOAD_REP = [0]  # the repetition whose workload scenarios build (`sluice bench run --seeds N`)
REP_SEED_STRIDE = 1000


def set_workload_rep(rep: int) -> None:
    """Scenarios build repetition `rep`'s workload from now on (0: the published one)."""
    _WORKLOAD_REP[0] = rep


def workload_rep() -> int:
    return _WORKLOAD_REP[0]


def workload_rng(seed: int) -> random.Random:
    """A scenario's workload randomness: Random(seed + REP_SEED_STRIDE x rep), so repetition 0 is the published
    workload and each further repetition (`--seeds N`) draws other arrivals of the same shape and rate."""
    return random.Random(seed + REP_SEED_STRIDE * _WORKLOAD_REP[0])


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least q % of the data at or below it); None for no
    data (the report shows "none"); `bench.loadgen.percentile` is the same rule with NaN for no data."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(1, math.ceil(q / 100.0 * len(ordered) - 1e-9))
    return ordered[min(k, len(ordered)) - 1]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def rnd(value: float | None, digits: int = 3) -> float | None:
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return None
    return round(float(value), digits)


# ---- workload helpers ----------------------------------------------------------------------------------------
_WORDS = FILLER_WORDS  # one token each on the simulator and on the real engines (bench/filler.py)


_TEXT_SCALE = [1.0]  # words per token of the replicas' tokenizer (1 for the simulator's)


def set_text_scale(words_per_token: float) -> None:
    """Real engines tokenize the filler words differently: the real backend measures words per token once
    (bench/backends.py) so that a prompt of N tokens in a scenario is N tokens on the engine too."""
    _TEXT_SCALE[0] = float(words_per_token)


def text_of(tokens: int, salt: int = 0) -> str:
    """Text the replicas' tokenizer counts as about `tokens` tokens (for the simulator's, short words are one
    token each; see `set_text_scale` for real engines).

    `salt` makes bodies distinct (a gateway may treat identical bodies from one tenant as retries)."""
    n = max(1, round(tokens * _TEXT_SCALE[0]))
    head = f"req{salt} "
    words = [_WORDS[(salt + i * 7) % len(_WORDS)] for i in range(n - 1)]
    return head + " ".join(words)


def chat(prompt_tokens: int, max_tokens: int, salt: int, stream: bool = True,
         system_tokens: int = 0, usage: bool = True) -> dict[str, Any]:
    """A chat completion body whose prompt is about `prompt_tokens` tokens after the chat template."""
    msgs = []
    overhead = 4 + 4
    if system_tokens:
        msgs.append({"role": "system", "content": text_of(system_tokens - 4, 10_000_000 + system_tokens)})
        prompt_tokens -= system_tokens
    msgs.append({"role": "user", "content": text_of(max(1, prompt_tokens - overhead), salt)})
    body: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "stream": stream}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


def scale_arrivals(arrivals: list[Arrival], time_scale: float) -> list[Arrival]:
    """Scenario seconds -> wall seconds for arrival times and client timers."""
    if time_scale == 1.0:
        return arrivals
    out = []
    for a in arrivals:
        c = a.client
        c2 = replace(c,
                     timeout_s=None if c.timeout_s is None else c.timeout_s / time_scale,
                     cancel_after_s=None if c.cancel_after_s is None else c.cancel_after_s / time_scale,
                     linger_s=None if c.linger_s is None else c.linger_s / time_scale,
                     read_interval_s=c.read_interval_s / time_scale,
                     sdk_backoff_s=c.sdk_backoff_s / time_scale,
                     read_timeout_s=c.read_timeout_s / time_scale,
                     business_backoff_s=c.business_backoff_s / time_scale)
        out.append(replace(a, at=a.at / time_scale, client=c2))
    return out


def ttfts_censored(run: RunData, recs: Iterable[Record]) -> list[float]:
    """Kept for the scenarios' readability: `RunData.ttfts` censors every attempt without a first token."""
    return run.ttfts(recs)


def flowing_at_end(call: Call) -> bool:
    """Completed, or still streaming tokens when the run ended (for streams meant to outlive the run, P12)."""
    f = call.final
    return call.ok or (f.status == 200 and f.error == "unfinished" and f.tokens > 0)


def slo_metrics(run: RunData, slo_ttft_s: float, class_of: Callable[[Call], str],
                refused: Iterable[str] = (), complete: Callable[[Call], bool] = lambda c: c.ok) -> dict[str, Any]:
    """The whole cost, the same for every scenario and system (SLO: the first token within `slo_ttft_s` of the
    user's first send, retries included, and the response completed):

      slo_goodput_rps      user-level calls meeting the SLO / offered seconds (every arrival counts once,
                           whatever it cost in attempts; a shed call retried into success counts with its whole
                           latency);
      offered_rps          user-level calls / offered seconds: the most any system's slo_goodput_rps can be;
      class_slo_goodput    the same per class (`class_of`), over the same offered seconds;
      class_ttft_p95_s     p95 of each class's TTFT from the first send, calls without a first token censored at
                           the time their user waited (a lower bound);
      class_calls          calls offered per class; class_failed: calls that did not complete (next to the p95).
    """
    ts = run.time_scale
    span = (run.duration or 1.0) * ts
    by_class: dict[str, list[Call]] = {}
    for c in run.calls():
        by_class.setdefault(class_of(c), []).append(c)

    def good(c: Call) -> bool:
        return complete(c) and c.ttft is not None and c.ttft * ts <= slo_ttft_s

    n_good = sum(1 for cs in by_class.values() for c in cs if good(c))
    return {
        "slo_goodput_rps": rnd(n_good / span, 3),
        "offered_rps": rnd(sum(len(cs) for cs in by_class.values()) / span, 3),
        "class_slo_goodput": {k: rnd(sum(1 for c in cs if good(c)) / span, 3) for k, cs in sorted(by_class.items())},
        "class_ttft_p95_s": {k: rnd(pct([c.waited * ts for c in cs], 95)) for k, cs in sorted(by_class.items())},
        "class_calls": {k: float(len(cs)) for k, cs in sorted(by_class.items())},
        "class_failed": {k: float(sum(1 for c in cs if not complete(c))) for k, cs in sorted(by_class.items())},
        "refused_classes": sorted(refused),
    }


def worst_class_ratio(by_system: dict[str, dict[str, Any]], refused: Iterable[str] = (),
                      system: str = "sluice") -> tuple[float | None, str | None]:
    """min over classes of `system`'s class goodput / the best other system's class goodput, leaving out the
    classes `system` refuses by design and classes no other system served within the SLO (0 / 0 says nothing;
    x / 0 is not a loss). Returns (ratio, the class that sets it)."""
    mine = (by_system.get(system) or {}).get("class_slo_goodput") or {}
    skip = set(refused)
    worst: tuple[float | None, str | None] = (None, None)
    for cls, value in mine.items():
        if cls in skip or value is None:
            continue
        best = max([((m or {}).get("class_slo_goodput") or {}).get(cls) or 0.0
                    for s, m in by_system.items() if s != system] or [0.0])
        if best <= 0:
            continue
        r = value / best
        if worst[0] is None or r < worst[0]:
            worst = (round(r, 3), cls)
    return worst


def phase_of(call: Call, run: RunData, phases: list[tuple[str, float]], last: str) -> str:
    """The phase a call was first sent in: the first (name, until) whose `until` (scenario seconds) is after
    its first send, else `last`."""
    t = call.first_send * run.time_scale
    for name, until in phases:
        if t < until:
            return name
    return last


def in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


@dataclass
class Metric:
    """A headline metric: key, what it means, unit, which direction is better."""

    key: str
    doc: str
    unit: str = ""
    better: str = "lower"  # lower | higher | "" (informational)


class Scenario:
    """Base class; subclasses set the class attributes and implement workload / metrics / reproduced."""

    id = "P0"
    title = ""
    problem = ""              # one line: the problem as PROBLEMS.md states it
    replicas = 2
    preset = BENCH_PRESET
    time_scale = 1.0
    sim_args: list[str] = []
    gateway: dict[str, Any] = {}        # gateway section, all systems (Envoy settings)
    sidecar: dict[str, Any] = {}        # sidecar section, all systems (only sluice runs a sidecar)
    limits: dict[str, Any] = {}
    slo_ttft_s = 2.0                    # the user's SLO: first token within this many seconds of the first send
    sluice_facts: dict[str, Any] = {}   # deployment facts sluice is told besides the SLO (tenants, task budget)
    refused_classes: tuple[str, ...] = ()  # classes sluice refuses by design (left out of worst_class_ratio)
    streams_outlive_run = False         # True: "completed" in the SLO means completed or still flowing at the end
    tenant_requests: dict[str, tuple[int, int]] = {}  # tenant -> its typical (prompt, output) tokens: a
                                        # tenant scenario; envoy-tuned rate-limits each tenant (bench/runner.py)
    poll_sidecar: tuple[str, ...] = ()  # sidecar metric names to poll over time (sluice only)
    poll_envoy: tuple[str, ...] = ()    # Envoy admin /stats/prometheus names to poll over time (every system)
    rss_poll: bool = False              # sample Envoy + sidecar RSS over time
    nofile: int = 0                     # RLIMIT_NOFILE this scenario needs in the harness
    client_rcvbuf: int = 0              # SO_RCVBUF of the load generator's sockets (0 = OS default)
    settle_s: float = 0.0               # after the load, wait up to this long (wall) for idle replicas
    budget_s = 20.0                     # rough wall budget per system-run in --quick mode (documentation)
    derived_values: dict[str, Any] = {}  # the numbers the docstring derives, as computed at this preset
    systems: tuple[str, ...] = ()       # setups of its own to compare instead of the harness's systems (PG: two
                                        # sluice deployments); such a scenario runs each through `run_system`
    reproduced_on = "envoy-rr"          # the column `reproduced` judges
    metrics_doc: list[Metric] = []
    headline: tuple[str, ...] = ()      # the keys the summary's overview table shows

    @property
    def sluice_policy(self) -> dict[str, Any]:
        """What sluice is told beyond its shipped defaults: the user's SLO as `admission.ttft_target_s` and the
        scenario's deployment facts (`sluice_facts`); nothing else (tests/bench/test_harness_units.py checks)."""
        policy = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.sluice_facts.items()}
        policy.setdefault("admission", {})["ttft_target_s"] = float(self.slo_ttft_s)
        return policy

    def with_replicas(self, n: int) -> "Scenario":
        """The scenario on a pool of `n` replicas (two real engines fill this machine): a copy whose rates
        follow `self.replicas` wherever the scenario derives them from the pool's size."""
        other = copy.copy(self)
        other.replicas = n
        return other

    def call_class(self, call: Call, run: RunData) -> str:
        """The class a user-level call belongs to in `class_slo_goodput` (default: its arrival kind)."""
        return call.kind

    def slo(self, run: RunData) -> dict[str, Any]:
        done = flowing_at_end if self.streams_outlive_run else (lambda c: c.ok)
        return slo_metrics(run, self.slo_ttft_s, lambda c: self.call_class(c, run), self.refused_classes, done)

    def workload(self, quick: bool) -> Workload:
        raise NotImplementedError

    def metrics(self, run: RunData) -> dict[str, float | None]:
        raise NotImplementedError

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        """Does this column show the problem? (bool, one line why)."""
        raise NotImplementedError

    def run_system(self, system: str, quick: bool, seed: int, workdir: Any,
                   backend: Any) -> tuple[RunData | None, dict[str, Any]]:
        """Start, replay and stop one of `systems` (only scenarios that set `systems`); as bench.runner.run_one."""
        raise NotImplementedError

    async def during(self, ctl: Any, run: RunData, quick: bool) -> None:
        """Optional extra control during the run (sampling, probes); faults go in Workload.faults."""
        return None

    def describe(self) -> str:
        """The scenario module's docstring: workload, SLO, headline metrics, reproduction rule, sluice knobs."""
        import sys

        mod = sys.modules.get(type(self).__module__)
        doc = ((mod.__doc__ if mod is not None else None) or type(self).__doc__ or "").strip()
        return doc + "\n\n" + self.derived_line()

    def derived_line(self) -> str:
        """The derived numbers at the preset in use (the docstring says how each is derived)."""
        vals = {"ttft_target_s": f"{self.slo_ttft_s:g}", **{k: _fmt_derived(v) for k, v in self.derived_values.items()}}
        if self.sim_args:
            vals["engine flags"] = " ".join(self.sim_args)
        return (f"Derived at the `{self.preset}` preset (bench/capacity.py): "
                + ", ".join(f"{k}: {v}" for k, v in vals.items()) + ".")


def _fmt_derived(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def client(**kw: Any) -> ClientSpec:
    return ClientSpec(**kw)
