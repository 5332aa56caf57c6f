"""seq_cap.py: the engine's max_num_seqs is learned from turnover at a steady running count, not from scrapes
that caught one long engine step, nor from waits for KV."""

from __future__ import annotations

from extproc.admission.seq_cap import CONFIRM, SeqCap
from extproc.routing.pool import Replica
from extproc.routing.scrape import ScrapedState


def _feed(rows: list[tuple[float, int, int, float, float]], r: Replica | None = None,
          cap: SeqCap | None = None) -> Replica:
    """rows: (scraped_at, running, waiting, kv_usage, first_tokens_total), scraped and learned in order."""
    r = r or Replica(address="a:1", pool="m")
    cap = cap or SeqCap()
    for at, running, waiting, kv, firsts in rows:
        r.on_scrape(ScrapedState(scraped_at=at, running=running, waiting=waiting, kv_usage=kv,
                                 first_tokens_total=firsts))
        cap.update([r])
    return r


def test_scrapes_within_one_long_prefill_step_do_not_teach_a_cap():
    """PX's replay (tiny-cpu, a 64-seq engine, prompts of 2-6k tokens, scraped every 0.15 s): a 2,048-token chunk
    over a long prefix holds the engine in one step for most of a second, so consecutive pages show the same
    running count with requests waiting for the step's token budget and no request starting in between."""
    rows = [(0.90, 3, 2, 0.29, 2), (1.05, 3, 2, 0.29, 2), (1.20, 3, 2, 0.29, 2),
            (1.35, 4, 3, 0.38, 2), (1.50, 4, 3, 0.38, 2), (1.65, 4, 3, 0.38, 2), (1.80, 4, 3, 0.38, 2),
            (2.10, 6, 4, 0.46, 3), (2.25, 6, 4, 0.46, 3), (2.40, 6, 4, 0.46, 3), (2.55, 6, 4, 0.46, 3)]
    assert _feed(rows).max_num_seqs == 0


def test_a_cap_is_learned_when_requests_keep_starting_at_the_same_running_count():
    rows = [(1.0 + 0.2 * i, 64, 5, 0.3, 100 + 3 * i) for i in range(CONFIRM)]
    r = _feed(rows[:-1])
    assert r.max_num_seqs == 0
    cap = SeqCap()
    r = _feed(rows[:-1], cap=cap)
    assert _feed(rows[-1:], r, cap).max_num_seqs == 64
    # pages between them that caught no new start neither count nor break the run
    rows = [(1.0, 64, 5, 0.3, 10), (1.1, 64, 5, 0.3, 10), (1.2, 64, 5, 0.3, 12), (1.3, 64, 5, 0.3, 12),
            (1.4, 64, 5, 0.3, 13)]
    assert _feed(rows).max_num_seqs == 64


def test_a_count_below_what_the_engine_already_ran_is_not_its_cap():
    rows = [(0.5, 40, 0, 0.2, 0)] + [(1.0 + 0.2 * i, 20, 5, 0.3, 10 + i) for i in range(2 * CONFIRM)]
    assert _feed(rows).max_num_seqs == 0


def test_requests_too_large_for_the_free_kv_wait_for_blocks_not_for_a_slot():
    r = Replica(address="a:1", pool="m", kv_capacity_tokens=20_000)
    r.placed_prompt_total, r.placed_requests_total = 50_000, 10  # 5,000-token prompts; 4,400 tokens free
    rows = [(1.0 + 0.2 * i, 4, 2, 0.78, 10 + i) for i in range(2 * CONFIRM)]
    assert _feed(rows, r).max_num_seqs == 0
    r2 = Replica(address="a:2", pool="m", kv_capacity_tokens=20_000)
    r2.placed_prompt_total, r2.placed_requests_total = 5_000, 10  # 500-token prompts fit: a slot cap
    assert _feed(rows, r2).max_num_seqs == 4
