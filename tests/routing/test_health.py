"""Every transition of the business-signal health state machine, with an injected clock."""

from __future__ import annotations

import logging
import uuid

import pytest
from prometheus_client import REGISTRY

from extproc.config import PoolConfig
from extproc.routing.health import HealthTracker
from extproc.routing.policy import HealthPolicy
from extproc.routing.pool import DEGRADED, EJECTED, HEALTHY, RECOVERING, Pool, Replica
from extproc.routing.scrape import ScrapedState

POLICY = HealthPolicy(ttft_p95_degraded_s=1.0, min_samples=5, tps_floor_per_request=2.0, tps_min_busy=1.0,
                      tps_min_span_s=2.0, error_rate_degraded=0.2, error_min_samples=10, error_window_s=10.0,
                      scrape_failures_degraded=2, scrape_failures_ejected=5, degraded_weight=0.25,
                      eject_after_s=20.0, recover_after_s=10.0, ejected_min_s=10.0, probe_interval_s=5.0,
                      probe_min_samples=1, slow_start_steps=(0.1, 0.3, 0.5, 1.0), slow_start_step_s=5.0,
                      slow_start_healthy_factor=0.8, relapse_factor=1.0, fallback_weight=0.2)


def make(n: int = 2, slo: float | None = None, **overrides) -> tuple[Pool, HealthTracker]:
    pool = Pool.from_config(PoolConfig(model=f"h-{uuid.uuid4().hex[:8]}",
                                       replicas=[f"127.0.0.1:{7000 + i}" for i in range(n)]))
    policy = HealthPolicy(**{**{f: getattr(POLICY, f) for f in POLICY.__dataclass_fields__}, **overrides})
    return pool, HealthTracker(pool, policy, slo_ttft_s=slo)


def scrape(r: Replica, now: float, *, ttft: float = 0.2, samples: float = 20, running: int = 2,
           waiting: int = 0, tps: float | None = None, span: float = 10.0, restarted: bool = False,
           recent: tuple[float, float] | None = None, prompt_tps: float = 0.0) -> None:
    """`recent`: (p95, first tokens) over the last slow-start step; default: the window's. `tps`: generated
    tokens/s; default: 100, less in proportion for a p95 TTFT over 0.5 s (a slow replica processes less)."""
    recent_ttft, recent_n = recent if recent is not None else (ttft, samples)
    if tps is None:
        tps = 100.0 * min(1.0, 0.5 / ttft) if ttft > 0 else 100.0
    r.on_scrape(ScrapedState(scraped_at=now, running=running, waiting=waiting, running_avg=float(running),
                             waiting_avg=float(waiting), generation_tps=tps, prompt_tps=prompt_tps,
                             window_span_s=span,
                             ttft_p95_s=ttft, ttft_count_window=samples, restarted=restarted,
                             ttft_p95_recent_s=recent_ttft, ttft_count_recent=recent_n))


def fail_scrapes(r: Replica, n: int, timeouts: bool = False) -> None:
    """`n` more failed scrapes: refused connections, or (`timeouts`) answers that came too late."""
    for _ in range(n):
        r.engine.scrape_failures += 1
        r.engine.scrape_timeouts += timeouts


def round_(pool: Pool, tracker: HealthTracker, now: float, **kw) -> None:
    """Every replica scraped with the same numbers, then evaluated."""
    for r in pool.replicas:
        scrape(r, now, **kw)
    tracker.on_scrape_round(now)


def transitions(pool: Pool, r: Replica, frm: str, to: str, reason: str) -> float:
    return REGISTRY.get_sample_value("sluice_replica_health_transitions_total",
                                     {"pool": pool.model, "replica": r.address, "from": frm, "to": to,
                                      "reason": reason}) or 0.0


def state_gauge(pool: Pool, r: Replica, state: str) -> float | None:
    return REGISTRY.get_sample_value("sluice_replica_state", {"pool": pool.model, "replica": r.address,
                                                              "state": state})


def all_degraded(pool: Pool) -> float | None:
    return REGISTRY.get_sample_value("sluice_pool_all_degraded", {"pool": pool.model})


# ---- HEALTHY -> DEGRADED ------------------------------------------------------------------------------------

def test_good_signals_stay_healthy():
    pool, tr = make()
    for t in range(0, 100, 5):
        round_(pool, tr, float(t))
    assert [r.state for r in pool.replicas] == [HEALTHY, HEALTHY]
    assert all(r.weight == 1.0 for r in pool.replicas)
    assert state_gauge(pool, pool.replicas[0], HEALTHY) == 1.0


def test_slow_ttft_degrades_with_enough_samples_only(caplog):
    pool, tr = make()
    a, b = pool.replicas
    scrape(a, 1.0, ttft=3.0, samples=4)       # too few first tokens to judge
    scrape(b, 1.0)
    tr.on_scrape_round(1.0)
    assert a.state == HEALTHY
    with caplog.at_level(logging.INFO, logger="sluice.routing.health"):
        scrape(a, 2.0, ttft=3.0, samples=5)
        tr.on_scrape_round(2.0)
        tr.on_scrape_round(2.2)               # still bad: no second transition, no second log line
    assert a.state == DEGRADED and a.weight == 0.25
    assert a.state_since == 2.0 and a.state_reason.startswith("ttft_p95")
    assert transitions(pool, a, HEALTHY, DEGRADED, "ttft_p95") == 1.0
    assert state_gauge(pool, a, DEGRADED) == 1.0 and state_gauge(pool, a, HEALTHY) == 0.0
    assert REGISTRY.get_sample_value("sluice_replica_weight", {"pool": pool.model, "replica": a.address}) == 0.25
    assert len([r for r in caplog.records if a.address in r.getMessage()]) == 1
    assert b.state == HEALTHY


def test_tps_collapse_degrades_a_busy_replica_but_not_an_idle_one():
    pool, tr = make()
    a, b = pool.replicas
    scrape(a, 1.0, running=0, tps=0.0)        # idle: generates nothing and is fine
    scrape(b, 1.0, running=4, tps=6.0, span=1.0)  # window too short to judge
    tr.on_scrape_round(1.0)
    assert (a.state, b.state) == (HEALTHY, HEALTHY)
    scrape(b, 3.0, running=4, tps=6.0, span=3.0)  # 1.5 tokens/s per running request < 2
    tr.on_scrape_round(3.0)
    assert b.state == DEGRADED and b.state_reason.startswith("tps_collapse")
    assert transitions(pool, b, HEALTHY, DEGRADED, "tps_collapse") == 1.0


def test_hang_with_only_waiting_requests_is_a_tps_collapse():
    pool, tr = make()
    a = pool.replicas[0]
    scrape(a, 5.0, running=0, waiting=6, tps=0.0, samples=0)
    tr.on_scrape_round(5.0)
    assert a.state == DEGRADED and a.state_reason.startswith("tps_collapse")


def test_error_rate_from_access_log_outcomes():
    pool, tr = make()
    a, b = pool.replicas
    for i in range(7):
        tr.on_outcome(a.address, "completed", 1.0)
    for i in range(2):
        tr.on_outcome(a.address, "failed", 1.0)
    for i in range(20):
        tr.on_outcome(a.address, "cancelled", 1.0)  # the client's doing: not counted at all
    round_(pool, tr, 1.5)
    assert a.state == HEALTHY                 # 9 finished < error_min_samples
    assert tr.error_counts(a, 1.5) == (9, 2)
    tr.on_outcome(a.address, "timeout", 2.0)  # 3 errors / 10 = 30 % > 20 %
    round_(pool, tr, 2.0)
    assert a.state == DEGRADED and a.state_reason.startswith("error_rate")
    assert tr.error_counts(a, 13.0) == (0, 0)  # outside the 10 s window
    tr.on_outcome("10.9.9.9:1", "failed", 2.0)  # not in the pool: ignored
    assert b.state == HEALTHY


def test_unreachable_degrades_then_ejects():
    pool, tr = make()
    a, b = pool.replicas
    round_(pool, tr, 1.0)
    fail_scrapes(a, 1)
    tr.on_scrape_round(1.2)
    assert a.state == HEALTHY                 # one failed scrape is noise
    fail_scrapes(a, 1)
    tr.on_scrape_round(1.4)
    assert a.state == DEGRADED and a.state_reason.startswith("unreachable")
    fail_scrapes(a, 3)
    tr.on_scrape_round(2.0)
    assert a.state == EJECTED and a.weight == 0.0 and not a.routable
    assert transitions(pool, a, DEGRADED, EJECTED, "unreachable") == 1.0


def test_healthy_straight_to_ejected_when_failures_pile_up_between_rounds():
    pool, tr = make()
    a = pool.replicas[0]
    fail_scrapes(a, 5)
    tr.tick(1.0)
    assert a.state == EJECTED
    assert transitions(pool, a, HEALTHY, EJECTED, "unreachable") == 1.0


# ---- DEGRADED -> HEALTHY / EJECTED --------------------------------------------------------------------------

def test_degraded_recovers_after_recover_after_s_of_good_signals():
    pool, tr = make()
    a, b = pool.replicas
    scrape(a, 0.0, ttft=3.0)
    scrape(b, 0.0)
    tr.on_scrape_round(0.0)
    assert a.state == DEGRADED
    scrape(a, 1.0)                            # good from t=1
    tr.on_scrape_round(1.0)
    scrape(a, 6.0, ttft=3.0)                  # bad again at t=6: the good timer restarts
    tr.on_scrape_round(6.0)
    scrape(a, 7.0)
    tr.on_scrape_round(7.0)
    tr.tick(16.9)
    assert a.state == DEGRADED
    tr.tick(17.0)
    assert a.state == HEALTHY and a.weight == 1.0 and a.state_since == 17.0
    assert transitions(pool, a, DEGRADED, HEALTHY, "signals_ok") == 1.0


def test_degraded_escalates_to_ejected_after_eject_after_s():
    pool, tr = make()
    a, b = pool.replicas
    for t in (0.0, 10.0, 19.9):
        scrape(a, t, ttft=3.0)
        scrape(b, t)
        tr.on_scrape_round(t)
        assert a.state == DEGRADED
    scrape(a, 20.0, ttft=3.0)
    tr.on_scrape_round(20.0)
    assert a.state == EJECTED and a.weight == 0.0 and a.state_since == 20.0
    assert transitions(pool, a, DEGRADED, EJECTED, "ttft_p95") == 1.0


# ---- EJECTED: probes, recovery ------------------------------------------------------------------------------

def eject(pool: Pool, tr: HealthTracker, r: Replica, at: float = 0.0) -> None:
    scrape(r, at, ttft=3.0)
    tr.on_scrape_round(at)
    scrape(r, at + 20.0, ttft=3.0)
    for o in pool.replicas:
        if o is not r:
            scrape(o, at + 20.0)
    tr.on_scrape_round(at + 20.0)
    assert r.state == EJECTED


def test_probe_pacing():
    pool, tr = make()
    a, b = pool.replicas
    assert not tr.allow_probe(b, 0.0)         # healthy replicas need no probe
    eject(pool, tr, a)
    assert tr.allow_probe(a, 21.0)
    assert not tr.allow_probe(a, 21.1)
    assert not tr.allow_probe(a, 25.9)
    assert tr.allow_probe(a, 26.0)
    fail_scrapes(a, 2)                        # does not answer: no probe can help
    assert not tr.allow_probe(a, 40.0)


def test_ejected_waits_ejected_min_s_and_a_bad_probe_keeps_it_out():
    pool, tr = make()
    a, b = pool.replicas
    eject(pool, tr, a)                        # ejected at t=20
    scrape(a, 25.0, ttft=0.0, samples=0, running=0, tps=0.0)  # no traffic, nothing bad
    tr.on_scrape_round(25.0)
    assert a.state == EJECTED                 # ejected_min_s not over
    scrape(a, 30.0, ttft=4.0, samples=1, running=0)  # one probe, slow first token
    tr.on_scrape_round(30.0)
    assert a.state == EJECTED
    scrape(a, 31.0, ttft=0.3, samples=1, running=0)  # the probe window now looks good
    tr.on_scrape_round(31.0)
    assert a.state == RECOVERING and a.weight == 0.1 and a.routable
    assert transitions(pool, a, EJECTED, RECOVERING, "signals_ok") == 1.0


# ---- RECOVERING: slow start ---------------------------------------------------------------------------------

def recovering(pool: Pool, tr: HealthTracker, r: Replica, at: float = 0.0) -> None:
    fail_scrapes(r, 5)
    tr.on_scrape_round(at)
    assert r.state == EJECTED
    scrape(r, at + 1.0)
    tr.on_scrape_round(at + 1.0)
    assert r.state == RECOVERING and r.weight == 0.1


def test_slow_start_advances_one_step_per_step_s_while_ttft_is_healthy():
    pool, tr = make()
    a, b = pool.replicas
    recovering(pool, tr, a)                   # RECOVERING at t=1
    weights = []
    for t in (3.0, 5.9, 6.0, 8.0, 11.0, 14.0, 16.0):
        scrape(a, t, ttft=0.5)
        tr.on_scrape_round(t)
        weights.append((t, a.state, a.weight))
    assert weights == [(3.0, RECOVERING, 0.1), (5.9, RECOVERING, 0.1), (6.0, RECOVERING, 0.3),
                       (8.0, RECOVERING, 0.3), (11.0, RECOVERING, 0.5), (14.0, RECOVERING, 0.5),
                       (16.0, HEALTHY, 1.0)]
    assert transitions(pool, a, RECOVERING, HEALTHY, "slow_start_done") == 1.0
    assert REGISTRY.get_sample_value("sluice_replica_weight", {"pool": pool.model, "replica": a.address}) == 1.0


def test_slow_start_backs_off_a_step_when_its_last_step_was_slow_and_climbs_again():
    """P6: the ramp follows the replica's own first tokens: up a step per step_s while the p95 of the step's first
    tokens is within slow_start_healthy_factor x the target, down a step when not (no ejection below the relapse
    bar), up again once it keeps up."""
    pool, tr = make(slo=1.0)
    a = pool.replicas[0]
    recovering(pool, tr, a)                   # t=1, weight 0.1
    scrape(a, 6.0, ttft=0.5)
    tr.on_scrape_round(6.0)
    scrape(a, 11.0, ttft=0.5)
    tr.on_scrape_round(11.0)
    assert a.weight == 0.5
    scrape(a, 16.0, ttft=0.7, recent=(0.9, 4))  # over 0.8 x the 1 s SLO in its last step, under the relapse bar
    tr.on_scrape_round(16.0)
    assert (a.state, a.weight) == (RECOVERING, 0.3) and "back off" in a.state_reason
    scrape(a, 18.0, ttft=0.7, recent=(0.9, 4))
    tr.on_scrape_round(18.0)
    assert a.weight == 0.3                    # one move per step_s
    scrape(a, 21.0, ttft=0.7, recent=(0.3, 4))
    tr.on_scrape_round(21.0)
    assert a.weight == 0.5
    scrape(a, 26.0, ttft=0.7, recent=(0.0, 0))  # no first tokens in its last step: nothing says no
    tr.on_scrape_round(26.0)
    assert (a.state, a.weight) == (HEALTHY, 1.0)
    assert transitions(pool, a, RECOVERING, HEALTHY, "slow_start_done") == 1.0
    assert transitions(pool, a, RECOVERING, EJECTED, "ttft_p95") == 0.0


def test_slow_start_at_the_first_step_stays_there_when_slow():
    pool, tr = make(slo=1.0)
    a = pool.replicas[0]
    recovering(pool, tr, a)
    for t in (6.0, 11.0, 16.0):
        scrape(a, t, ttft=0.9, samples=3)
        tr.on_scrape_round(t)
        assert (a.state, a.weight) == (RECOVERING, 0.1)


def test_slow_start_ramps_while_no_worse_than_a_busy_pool():
    """The whole pool is over the SLO (busy): a recovering replica as fast as its peers ramps up (the pool needs
    it); one 3x slower than them relapses."""
    pool, tr = make(3, slo=0.5, ttft_p95_degraded_s=15.0)
    a, b, c = pool.replicas
    recovering(pool, tr, a)                   # t=1
    for t in (6.0, 11.0):
        scrape(a, t, ttft=1.1)                # within 0.8 x the others' median 1.5 s
        scrape(b, t, ttft=1.6)
        scrape(c, t, ttft=1.4)
        tr.on_scrape_round(t)
    assert a.weight == 0.5
    scrape(a, 12.0, ttft=5.0, samples=3)      # > 3 x the others' median 1.5 s
    scrape(b, 12.0, ttft=1.6)
    scrape(c, 12.0, ttft=1.4)
    tr.on_scrape_round(12.0)
    assert a.state == EJECTED and "relapse" in a.state_reason


def test_relapse_during_slow_start_goes_back_to_ejected():
    pool, tr = make()
    a = pool.replicas[0]
    recovering(pool, tr, a)
    scrape(a, 6.0)
    tr.on_scrape_round(6.0)
    assert a.weight == 0.3
    scrape(a, 7.0, ttft=1.5, samples=2)       # a couple of slow first tokens at 30 % traffic
    tr.on_scrape_round(7.0)
    assert a.state == EJECTED and a.weight == 0.0
    assert "relapse" in a.state_reason
    assert transitions(pool, a, RECOVERING, EJECTED, "ttft_p95") == 1.0
    scrape(a, 8.0, ttft=1.5, samples=2)
    tr.on_scrape_round(8.0)
    assert a.state == EJECTED                 # no oscillation while the bad samples are in the window


def test_relapse_when_unreachable_again():
    pool, tr = make()
    a = pool.replicas[0]
    recovering(pool, tr, a)
    fail_scrapes(a, 2)
    tr.on_scrape_round(2.0)
    assert a.state == EJECTED and a.state_reason.startswith("unreachable")


# ---- crash -> recover, restarts ------------------------------------------------------------------------------

def test_crash_then_recover_enters_slow_start_not_healthy():
    pool, tr = make()
    a, b = pool.replicas
    round_(pool, tr, 0.0)
    for i in range(1, 6):                     # the process died: every scrape fails
        fail_scrapes(a, 1)
        scrape(b, i * 0.2)
        tr.on_scrape_round(i * 0.2)
    assert a.state == EJECTED
    assert tr.allow_probe(a, 1.5) is False    # unreachable: no probes
    scrape(a, 30.0, restarted=True, samples=0, running=0)  # back, with an empty engine
    tr.on_scrape_round(30.0)
    assert a.state == RECOVERING and a.weight == 0.1
    assert transitions(pool, a, EJECTED, RECOVERING, "restarted") == 1.0


def test_outage_failures_do_not_relapse_the_slow_start_that_follows_it():
    """Regression (P6): the requests that failed when the replica crashed were still in the error window when it
    answered again, so slow start relapsed on the first evaluation and the replica sat out ejected_min_s."""
    pool, tr = make()
    a, b = pool.replicas
    round_(pool, tr, 0.0)
    for i in range(8):
        tr.on_outcome(a.address, "completed", 0.5)
    for i in range(6):                       # the crash: in-flight requests fail (6/14 > 20 %)
        tr.on_outcome(a.address, "failed", 1.0)
    for i in range(1, 6):
        fail_scrapes(a, 1)
        scrape(b, 1.0 + i * 0.2)
        tr.on_scrape_round(1.0 + i * 0.2)
    assert a.state == EJECTED
    scrape(a, 4.0, samples=0, running=0)     # back 3 s later, well within the 10 s error window
    scrape(b, 4.0)
    tr.on_scrape_round(4.0)
    assert a.state == RECOVERING and a.weight == 0.1
    scrape(a, 4.2, samples=0, running=0)
    scrape(b, 4.2)
    tr.on_scrape_round(4.2)
    assert a.state == RECOVERING, a.state_reason
    tr.on_outcome(a.address, "failed", 4.5)  # failures after the return still count
    assert tr.error_counts(a, 4.5) == (1, 1)


def test_back_after_a_short_outage_while_degraded_enters_slow_start():
    pool, tr = make()
    a = pool.replicas[0]
    round_(pool, tr, 0.0)
    fail_scrapes(a, 3)
    tr.on_scrape_round(1.0)
    assert a.state == DEGRADED
    scrape(a, 1.2)
    tr.on_scrape_round(1.2)
    assert a.state == RECOVERING and transitions(pool, a, DEGRADED, RECOVERING, "reachable") == 1.0


def test_engine_restart_seen_in_counters_sends_a_healthy_replica_to_slow_start():
    pool, tr = make()
    a = pool.replicas[0]
    round_(pool, tr, 0.0)
    scrape(a, 0.2, restarted=True)
    tr.on_scrape_round(0.2)
    assert a.state == RECOVERING
    tr.on_scrape_round(0.4)                   # the same scrape is not a second restart
    assert a.state == RECOVERING and transitions(pool, a, HEALTHY, RECOVERING, "restarted") == 1.0


def test_ejected_for_ttft_then_unreachable_comes_back_through_slow_start():
    pool, tr = make()
    a = pool.replicas[0]
    eject(pool, tr, a)
    fail_scrapes(a, 2)
    tr.on_scrape_round(21.0)
    assert a.state == EJECTED and a.state_reason.startswith("unreachable")
    scrape(a, 22.0)
    tr.on_scrape_round(22.0)                  # no ejected_min_s wait: it answers again
    assert a.state == RECOVERING


# ---- never zero capacity ------------------------------------------------------------------------------------

def test_last_routable_replica_is_held_degraded_and_pool_says_all_degraded(caplog):
    pool, tr = make(2)
    a, b = pool.replicas
    eject(pool, tr, a)                        # a ejected at t=20, b healthy
    assert all_degraded(pool) == 0.0
    with caplog.at_level(logging.WARNING, logger="sluice.routing.health"):
        scrape(b, 21.0, ttft=3.0)
        scrape(a, 21.0, ttft=3.0)
        tr.on_scrape_round(21.0)
        assert b.state == DEGRADED and tr.all_degraded and all_degraded(pool) == 1.0
        for t in (41.0, 60.0, 90.0):          # long past eject_after_s
            scrape(b, t, ttft=3.0)
            scrape(a, t, ttft=3.0)
            tr.on_scrape_round(t)
            assert b.state == DEGRADED and b.routable   # never escalated: the pool would have nothing
    assert len([r for r in caplog.records if "every replica is degraded" in r.getMessage()]) == 1
    # a recovers: the held replica is released and, still bad, ejected
    scrape(a, 100.0)
    scrape(b, 100.0, ttft=3.0)
    tr.on_scrape_round(100.0)
    assert a.state == RECOVERING
    assert b.state == EJECTED and transitions(pool, b, DEGRADED, EJECTED, "fallback_released") == 1.0
    assert not tr.all_degraded and all_degraded(pool) == 0.0


def test_all_ejected_serves_from_the_best_reachable_one():
    pool, tr = make(3)
    a, b, c = pool.replicas
    for r in pool.replicas:
        recovering(pool, tr, r)
    fail_scrapes(c, 5)                        # c is down: it cannot be the fallback
    scrape(a, 2.0, ttft=4.0, samples=10)
    scrape(b, 2.0, ttft=2.0, samples=10)       # the best: lowest p95
    tr.on_scrape_round(2.0)
    assert a.state == EJECTED and c.state == EJECTED
    assert b.state == DEGRADED and b.weight == 0.2 and b.routable
    assert b.state_reason.startswith("pool_fallback")
    assert transitions(pool, b, EJECTED, DEGRADED, "pool_fallback") == 1.0
    assert all_degraded(pool) == 1.0
    for t in (30.0, 60.0):                    # held, no churn
        scrape(a, t, ttft=4.0, samples=10)
        scrape(b, t, ttft=2.0, samples=10)
        tr.on_scrape_round(t)
        assert b.state == DEGRADED and a.state == EJECTED
    assert transitions(pool, b, EJECTED, DEGRADED, "pool_fallback") == 1.0
    assert pool.candidates() == [b]


def test_no_fallback_onto_replicas_that_do_not_answer():
    pool, tr = make(2)
    for r in pool.replicas:
        fail_scrapes(r, 5)
    tr.on_scrape_round(1.0)
    assert [r.state for r in pool.replicas] == [EJECTED, EJECTED]
    assert pool.candidates() == [] and tr.all_degraded


def test_fallback_prefers_replicas_with_ttft_samples():
    pool, tr = make(2)
    a, b = pool.replicas
    for r in pool.replicas:
        recovering(pool, tr, r)
    scrape(a, 2.0, ttft=0.0, samples=0, running=3, tps=0.0, span=5.0)   # hung: no first tokens at all
    scrape(b, 2.0, ttft=5.0, samples=2)                                 # slow but serving
    tr.on_scrape_round(2.0)
    assert b.state == DEGRADED and a.state == EJECTED


# ---- misc ---------------------------------------------------------------------------------------------------

def test_disabled_policy_changes_nothing():
    pool, tr = make(enabled=False)
    a = pool.replicas[0]
    fail_scrapes(a, 10)
    scrape(pool.replicas[1], 1.0, ttft=30.0)
    tr.on_scrape_round(1.0)
    assert [r.state for r in pool.replicas] == [HEALTHY, HEALTHY]


def test_status_snapshot():
    pool, tr = make()
    a = pool.replicas[0]
    scrape(a, 1.0, ttft=3.0)
    tr.on_scrape_round(1.0)
    st = {s["replica"]: s for s in tr.status()}
    assert st[a.address]["state"] == DEGRADED and st[a.address]["weight"] == 0.25


@pytest.mark.parametrize("outcome", ["cancelled", "weird"])
def test_outcomes_that_say_nothing_about_the_replica(outcome):
    pool, tr = make()
    a = pool.replicas[0]
    for _ in range(50):
        tr.on_outcome(a.address, outcome, 1.0)
    assert tr.error_counts(a, 1.0) == (0, 0)


def test_single_replica_pool_relapse_falls_back_and_recovers_through_slow_start():
    pool, tr = make(1)
    (a,) = pool.replicas
    recovering(pool, tr, a)                   # t=1
    scrape(a, 2.0, ttft=3.0, samples=10)      # relapse: EJECTED, then the pool's only replica is the fallback
    tr.on_scrape_round(2.0)
    assert a.state == DEGRADED and a.weight == 0.2 and a.state_reason.startswith("pool_fallback")
    assert transitions(pool, a, RECOVERING, EJECTED, "ttft_p95") == 1.0
    scrape(a, 3.0)                            # good from t=3
    tr.on_scrape_round(3.0)
    tr.tick(12.9)
    assert a.state == DEGRADED
    tr.tick(13.0)
    assert a.state == RECOVERING and a.weight == 0.1   # not straight back to full traffic
    assert not tr.all_degraded


def test_begin_slow_start_is_a_counted_transition_to_the_first_step():
    """An operator's undrain (admin service) starts slow start through the tracker: state, weight, reason,
    transition counter, and a step timer that starts now."""
    pool, tracker = make()
    a = pool.replicas[0]
    tracker.begin_slow_start(a, "undrain", "operator undrain", now=50.0)
    assert (a.state, a.weight, a.state_since) == (RECOVERING, 0.1, 50.0)
    assert a.state_reason == "undrain: operator undrain"
    assert transitions(pool, a, HEALTHY, RECOVERING, "undrain") == 1.0
    assert state_gauge(pool, a, RECOVERING) == 1.0


# ---- the pool as reference (issue 16: busy is not sick; P8: a sick replica stands out) -------------------------

def test_a_busy_pool_slows_together_and_nobody_is_degraded():
    pool, tr = make(3, slo=0.5, ttft_p95_degraded_s=15.0)
    for t in (1.0, 2.0, 30.0):
        round_(pool, tr, t, ttft=4.0)        # 8 x the SLO everywhere: load, not sickness
    assert [r.state for r in pool.replicas] == [HEALTHY] * 3
    round_(pool, tr, 31.0, ttft=16.0)         # the absolute ceiling still holds
    assert [r.state for r in pool.replicas] == [DEGRADED] * 3


def test_a_replica_much_slower_than_its_peers_and_over_the_slo_is_degraded():
    pool, tr = make(3, slo=1.0, ttft_p95_degraded_s=15.0)
    a, b, c = pool.replicas
    scrape(a, 1.0, ttft=2.9)                  # 3 x 0.3 = 0.9 < 2.9 but the bar is max(SLO 1, 0.9)... 2.9 > 1: sick
    scrape(b, 1.0, ttft=0.3)
    scrape(c, 1.0, ttft=0.3)
    tr.on_scrape_round(1.0)
    assert (a.state, b.state, c.state) == (DEGRADED, HEALTHY, HEALTHY)
    assert "others' median 0.3s" in a.state_reason
    assert transitions(pool, a, HEALTHY, DEGRADED, "ttft_p95") == 1.0


def test_slower_than_peers_but_within_the_slo_is_fine():
    pool, tr = make(3, slo=1.0, ttft_p95_degraded_s=15.0)
    a, b, c = pool.replicas
    scrape(a, 1.0, ttft=0.8)                  # 8 x its peers, yet within the SLO
    scrape(b, 1.0, ttft=0.1)
    scrape(c, 1.0, ttft=0.1)
    tr.on_scrape_round(1.0)
    assert a.state == HEALTHY


def test_two_replicas_compare_with_each_other():
    pool, tr = make(2, slo=1.0, ttft_p95_degraded_s=15.0)
    a, b = pool.replicas
    scrape(a, 1.0, ttft=2.0)
    scrape(b, 1.0, ttft=0.6)                  # 3 x 0.6 = 1.8 < 2.0
    tr.on_scrape_round(1.0)
    assert (a.state, b.state) == (DEGRADED, HEALTHY)
    tr.tick(1.2)
    assert tr.ttft_bar(b) == 15.0             # a is no longer a healthy peer: b has no reference


def test_peers_without_enough_first_tokens_are_no_reference():
    pool, tr = make(2, slo=1.0, ttft_p95_degraded_s=15.0)
    a, b = pool.replicas
    scrape(a, 1.0, ttft=5.0)
    scrape(b, 1.0, ttft=0.1, samples=2)       # < min_samples: says nothing about the pool
    tr.on_scrape_round(1.0)
    assert a.state == HEALTHY


def test_error_rate_is_judged_against_the_others():
    """Timeouts that hit every replica (clients' deadlines under load) are the load's: nobody is degraded. A
    replica failing while its peers do not is."""
    pool, tr = make(3)
    a, b, c = pool.replicas
    for r in pool.replicas:
        for _ in range(7):
            tr.on_outcome(r.address, "completed", 1.0)
        for _ in range(3):
            tr.on_outcome(r.address, "timeout", 1.0)
    round_(pool, tr, 1.5)
    assert [r.state for r in pool.replicas] == [HEALTHY] * 3
    for _ in range(20):
        tr.on_outcome(a.address, "failed", 2.0)
    round_(pool, tr, 2.0)
    assert (a.state, b.state, c.state) == (DEGRADED, HEALTHY, HEALTHY)
    assert a.state_reason.startswith("error_rate") and "+ the others' 30%" in a.state_reason


def complete(tr: HealthTracker, r: Replica, n: int, at: float, outcome: str = "completed") -> None:
    for _ in range(n):
        tr.on_outcome(r.address, outcome, at)


def test_a_high_ttft_while_it_keeps_pace_with_its_peers_is_load_not_sickness():
    """Two saturated real engines: p95 TTFT 4.86 s against the other's 0.98 s while both completed requests
    (307 and 351 over the burst). A replica that falls behind its peers' completions as well is sick (P8)."""
    pool, tr = make(2, slo=2.0, ttft_p95_degraded_s=15.0, tps_min_span_s=3.0)
    a, b = pool.replicas
    for t in range(1, 8):
        complete(tr, a, 5, t)                 # 5 and 6 completed a second: the same pace
        complete(tr, b, 6, t)
        if t < 3:
            continue                          # (the pace is judged over 3 s)
        scrape(a, t + 0.5, ttft=4.86)
        scrape(b, t + 0.5, ttft=0.98)
        tr.on_scrape_round(t + 0.5)
        assert (a.state, b.state) == (HEALTHY, HEALTHY), a.state_reason
    for t in range(8, 12):
        complete(tr, a, 1, t)                 # now it falls behind: 1 against 6 a second
        complete(tr, b, 6, t)
        scrape(a, t + 0.5, ttft=4.86)
        scrape(b, t + 0.5, ttft=0.98)
        tr.on_scrape_round(t + 0.5)
    assert (a.state, b.state) == (DEGRADED, HEALTHY)
    assert a.state_reason.startswith("ttft_p95")


def test_a_long_prompts_prefill_is_not_sickness_while_the_replica_keeps_the_token_pace():
    """P3: a replica given a 6,500-token prompt shows its 2 s prefill in its p95 TTFT (SLO 0.5 s, the peer's p95
    0.1 s) and completes a fraction of the peer's requests, since lanes keep the short ones off a long prefill;
    it processed as many tokens a second. A replica that processes a fraction of its peer's tokens is sick."""
    pool, tr = make(2, slo=0.5, ttft_p95_degraded_s=15.0, tps_min_span_s=3.0)
    a, b = pool.replicas
    for t in range(1, 8):
        complete(tr, a, 1, t)                 # 1 against 6 a second: behind in completions
        complete(tr, b, 6, t)
        scrape(a, t + 0.5, ttft=2.0, tps=20.0, prompt_tps=3200.0)
        scrape(b, t + 0.5, ttft=0.1, tps=100.0, prompt_tps=4600.0)
        tr.on_scrape_round(t + 0.5)
        assert (a.state, b.state) == (HEALTHY, HEALTHY), a.state_reason
    for t in range(8, 12):
        complete(tr, a, 1, t)
        complete(tr, b, 6, t)
        scrape(a, t + 0.5, ttft=2.0, tps=20.0, prompt_tps=800.0)   # now behind in tokens as well
        scrape(b, t + 0.5, ttft=0.1, tps=100.0, prompt_tps=4600.0)
        tr.on_scrape_round(t + 0.5)
    assert (a.state, b.state) == (DEGRADED, HEALTHY)
    assert a.state_reason.startswith("ttft_p95")


def test_the_absolute_ttft_ceiling_holds_while_a_replica_keeps_pace():
    """ttft_p95_degraded_s is a bar whatever the load: keeping pace excuses a TTFT between the peers' bar and it."""
    pool, tr = make(2, slo=2.0, ttft_p95_degraded_s=15.0, tps_min_span_s=3.0)
    a, b = pool.replicas
    for t in range(1, 5):
        complete(tr, a, 6, t)
        complete(tr, b, 6, t)
    scrape(a, 4.5, ttft=16.0, tps=100.0)
    scrape(b, 4.5, ttft=1.0, tps=100.0)
    tr.on_scrape_round(4.5)
    assert (a.state, b.state) == (DEGRADED, HEALTHY)


def test_errors_that_hit_a_degraded_peer_as_well_are_the_load():
    """Real engines, saturated: one replica degraded, then the other saw 8 of 28 requests fail while every
    replica failed alike. A degraded peer is still a reference for the error rate."""
    pool, tr = make(2, slo=1.0, ttft_p95_degraded_s=15.0)
    a, b = pool.replicas
    scrape(a, 1.0, ttft=5.0)
    scrape(b, 1.0, ttft=0.5)
    tr.on_scrape_round(1.0)
    assert a.state == DEGRADED
    complete(tr, a, 20, 2.0)
    complete(tr, a, 8, 2.0, "failed")
    complete(tr, b, 20, 2.0)
    complete(tr, b, 8, 2.0, "failed")
    scrape(a, 2.5, ttft=5.0)
    scrape(b, 2.5, ttft=0.5)
    tr.on_scrape_round(2.5)
    assert b.state == HEALTHY, b.state_reason
    complete(tr, b, 30, 3.0, "failed")        # failing alone: sick
    scrape(b, 3.5, ttft=0.5)
    tr.on_scrape_round(3.5)
    assert b.state == DEGRADED and b.state_reason.startswith("error_rate")


# ---- slow to report is not dead (issue 16) ------------------------------------------------------------------

def test_scrape_timeouts_while_it_completes_requests_never_take_a_replica_out():
    pool, tr = make()
    a, b = pool.replicas
    round_(pool, tr, 0.0)
    t = 0.0
    for _ in range(40):                       # 40 s of /metrics answering too late, requests completing
        t += 1.0
        fail_scrapes(a, 1, timeouts=True)
        tr.on_outcome(a.address, "completed", t - 0.5)
        scrape(b, t)
        tr.on_scrape_round(t)
        assert a.state == HEALTHY, a.state_reason
    assert a.engine.scrape_failures == 40
    assert transitions(pool, a, HEALTHY, DEGRADED, "unreachable") == 0.0
    assert transitions(pool, a, HEALTHY, EJECTED, "unreachable") == 0.0


def test_a_cancelled_request_the_replica_was_answering_is_a_sign_of_life():
    pool, tr = make()
    a = pool.replicas[0]
    round_(pool, tr, 0.0)
    fail_scrapes(a, 6, timeouts=True)
    tr.on_outcome(a.address, "cancelled", 3.0, answered=True)
    tr.on_scrape_round(6.0)
    assert a.state == HEALTHY
    tr.on_outcome(a.address, "cancelled", 9.0)  # left before any byte: says nothing
    tr.on_scrape_round(8.0)
    assert a.state == EJECTED and a.state_reason.startswith("unreachable")


def test_timeouts_with_no_sign_of_life_for_unresponsive_after_s_are_unreachable():
    """A frozen replica (SIGSTOP, a hung API server) accepts connections and answers nothing: its timeouts count
    once nothing has come from it for unresponsive_after_s (5 s here)."""
    pool, tr = make(unresponsive_after_s=5.0)
    a = pool.replicas[0]
    round_(pool, tr, 0.0)
    tr.on_outcome(a.address, "completed", 1.0)
    fail_scrapes(a, 5, timeouts=True)
    tr.on_scrape_round(5.9)                   # 4.9 s since the last completion
    assert a.state == HEALTHY
    tr.on_scrape_round(6.0)
    assert a.state == EJECTED and a.state_reason.startswith("unreachable")
    assert tr.allow_probe(a, 7.0) is False    # nothing answers: no probe either
    scrape(a, 8.0)                            # answers again
    tr.on_scrape_round(8.0)
    assert a.state == RECOVERING


def test_refused_connections_count_at_once_even_while_requests_complete():
    """Requests finishing on a replica that has just died do not hide its death: refused and reset scrapes are
    not timeouts."""
    pool, tr = make()
    a = pool.replicas[0]
    round_(pool, tr, 0.0)
    tr.on_outcome(a.address, "completed", 0.3)
    fail_scrapes(a, 1, timeouts=True)
    fail_scrapes(a, 2)
    tr.on_scrape_round(0.6)
    assert a.state == DEGRADED and a.state_reason.startswith("unreachable: 2 consecutive")


def test_a_flat_token_counter_is_no_collapse_while_requests_are_answered():
    """vLLM refreshes its counters in lumps seconds apart: a window without a lump reads as 0 tokens/s. The
    access log says whether the replica answers anything; a hung one answers nothing."""
    pool, tr = make()
    a, b = pool.replicas
    tr.on_outcome(a.address, "completed", 2.5)
    scrape(a, 3.0, running=4, tps=0.0, span=3.0, samples=0)
    scrape(b, 3.0, running=4, tps=0.0, span=3.0, samples=0)
    tr.on_scrape_round(3.0)
    assert (a.state, b.state) == (HEALTHY, DEGRADED)
    assert b.state_reason.startswith("tps_collapse")
    scrape(a, 6.0, running=4, tps=0.0, span=3.0, samples=0)  # the completion is older than the window now
    tr.on_scrape_round(6.0)
    assert a.state == DEGRADED


def test_slow_decode_on_every_replica_is_load_not_a_collapse():
    """Long prompts slow every replica's decode together (each engine step prefills a chunk and decodes one token
    per request, P10), and so do hundreds of streams on equally loaded replicas (P12): replicas that process
    tokens at their peers' pace stay HEALTHY, while one that processes none beside them is hung."""
    pool, tr = make(3)
    a, b, c = pool.replicas
    for r in (a, b):  # 1 generated token/s per running request, but 3,000 prompt tokens/s prefilled
        scrape(r, 3.0, running=4, tps=4.0, prompt_tps=3000.0, span=3.0, samples=0)
    scrape(c, 3.0, running=4, tps=0.0, prompt_tps=0.0, span=3.0, samples=0)  # hung: nothing at all
    tr.on_scrape_round(3.0)
    assert (a.state, b.state) == (HEALTHY, HEALTHY)
    assert c.state == DEGRADED and c.state_reason.startswith("tps_collapse")
    assert transitions(pool, a, HEALTHY, DEGRADED, "tps_collapse") == 0.0
