"""Where a prompt's prefix is cached, as far as the engines' own counters confirm it (prefix-aware placement).

Requests that share a prefix (an app's system prompt, a RAG template, the earlier turns of a chat, an agent's
growing context) prefill only their uncached tail on a replica whose prefix cache holds the shared part: a
4,000-token prompt with 3,968 tokens cached takes about 70 ms on the real CPU engine instead of 340 ms.

Which prefix: `LLMRequest.prefix_chain`, chained hashes of the prompt text's first `PREFIX_LADDER` characters
(512, 558, 608, ...: each level about 9 % longer, but at most PREFIX_STEP = 512 characters, about 128 tokens,
apart up to 32,768 characters, and 1/64 of the level beyond), computed once when the body is parsed. Two prompts
that share their first L characters share every level up to L, and the longest of them is less than one step
short of L: a cached prompt's predicted uncached part is its real tail plus at most one step, as block-granular
matching in the engine leaves its tail plus less than one block.

Where it may be cached: `PrefixAffinity` remembers, per level hash, the replicas this sidecar placed it on (the
KEEP most recent) in LRU order, at most MAX_ENTRIES hashes. The longest level a replica holds predicts the
prompt tokens its engine will find cached:

    cached(r)   = reusable(characters of that level x prompt tokens / prompt characters)  (x OLDER_HOLDER, below)
    reusable(t) = floor(min(t, prompt - 1) / block) x block

An engine reuses whole KV blocks only (vLLM: `block_size` of `vllm:cache_config_info`, 16 on GPUs, 128 on the
CPU backend; an engine that exports none is taken to share to the token, as SGLang's radix cache does), and
computes at least a prompt's last token: a prompt shorter than a block shares nothing, however often it is sent.

Whether it is cached (confirmed, never assumed from the hash): each placement adds its predicted cached tokens
(cached(r), with the holder's credit) to the replica's tally, and each scrape adds the engine's own prefix-cache
hits (the delta of `vllm:prefix_cache_hits_total`, in tokens), into two sums that forget by evidence, not by
scrape: a scrape that brings p predicted tokens scales both sums by 0.5^(p / HALF_EVIDENCE) first. Once the
predictions' sum reaches MIN_EVIDENCE tokens,

    confidence(r) = min(1, hits_sum / predicted_sum)       hits_sum <= SURPLUS x predicted_sum

A request placed just before a scrape is predicted in that window and prefilled, and counted by the engine, in
the next one; in the sums its late hits still meet their prediction. A confidence moved per window toward that
window's ratio instead swung with every such window (0.95 to 0.09 and back within seconds in PX), and, as a
multiplier of every prediction, pushed cached prompts of several thousand tokens into the long lane.

It starts at 0, so nothing is assumed before the counters agree: requests placed by load alone land on a
replica that already served their prefix often enough for the counters to show it. An engine with prefix
caching off, or evicting its cache under KV pressure, shows fewer hits than predicted, and the term fades.

A level placed on several replicas counts in full only on the one it was placed on last, and OLDER_HOLDER (0.5)
x on the others: an engine's LRU cache evicts first what it has not been asked for since, and, more to the point,
equal credit on two replicas lets load alone alternate an app's requests between them, so each caches every
app's prefix and, with a working set larger than one replica's cache, evicts them from each other (PX, hit rate
0.68 of the best achievable). With the credit on the latest holder, a prefix stays where it went last and moves
whole when it spills over.

The placement term (placement.py): a replica must compute `prompt - confidence(r) x cached(r)` tokens of the
prompt, and that is what its predicted TTFT, its prefill gate and the prefill backlog charged on placing use.

The home term: the prefix's home (`home`: the latest holder of the longest level placed) scores lower by

    home_term = HOME_STAY x cached(home) / prompt x min(1, cached(home) / (HOME_CACHE_SHARE x KV capacity))

(`home_term`: half a TTFT target times the share of the prompt expected cached at home, confidence included, for a
prefix of at least a tenth of the replica's KV, and in proportion below). The prefill term counts what a move
costs this request; a move also costs the requests after it: the other replica computes the prefix and caches it,
and with a prefix working set larger than one replica's cache that copy evicts as much of another app's prefixes
there, which later requests compute again. Meanwhile the KV and queue terms swing by a whole request at each
placement (a 6,000-token prompt is 0.3 of a 21,888-token cache). Without the home term, the smaller apps' prefixes
moved between the two real engines 28 times in PX's 12 s, at score margins mostly under 0.5. A copy of a prefix
that is small against the cache evicts little: one block of a templated one-liner gets almost no term, so
identical short prompts still spread by their sequences. A request leaves its home when the home does not fit it
(a gate of placement.py) or another replica scores better by more than the term.

Headroom counts the prefix once. Requests in flight on a replica that share a prefix share its KV blocks in the
engine, so a request adds to that replica's KV only what its in-flight neighbours do not already hold:

    footprint(r) = prompt + expected output - held(r)
    held(r)      = confidence(r) x reusable(characters of the longest level held by a request in flight on r
                                           x prompt tokens / prompt characters)

(`held_tokens`; a level is held from the placement of a request carrying it until that request ends). A prefix
whose blocks are cached but idle is not held: vLLM counts idle cached blocks as free
(`kv_cache_usage_perc` = 1 - free blocks / blocks, the free queue holding them), and a request reusing them
takes them back out of it, so its footprint is then the whole prompt. Counting every request's full prompt
instead made a replica serving one app's 6,000-token prompt look full after three of them, the KV gate refused
it and the app's next requests were computed cold on the other replica (PX: KV refusals were the commonest
reason, hit rate 0.77 of the best achievable).

In whole blocks, as the engine shares them: counted to the token, a held prefix made each copy of a short prompt
look nearly free on the replica already running one (with the prefix term, cheaper there than on an idle replica),
and identical short prompts gathered on one replica.

A hot prefix does not melt its replica: that replica's backlog, KV (its requests' tails and outputs), requests in
flight (the score's in-flight term), engine queue and concurrency rise like any other's, and once it no longer
fits or its score passes another replica's, the prefix spills there, which then caches it too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from extproc.request import PREFIX_LADDER, LLMRequest
from extproc.routing.pool import Replica

KEEP = 4               # replicas remembered per prefix level (most recent placements)
MAX_ENTRIES = 65_536   # prefix level hashes remembered per pool (LRU)
MIN_EVIDENCE = 2048.0  # predicted cached tokens needed before the counters are compared with them
HALF_EVIDENCE = 32_768.0  # predicted tokens after which a past prediction and its hits count half (the memory)
SURPLUS = 2.0          # hits remembered beyond the predictions, at most this x them (late hits, below)
OLDER_HOLDER = 0.5     # a level's holders other than its most recent placement count this share of it cached
HOME_STAY = 0.5        # the home term (score units: TTFT targets) for a prompt cached whole at its prefix's home
HOME_CACHE_SHARE = 0.1  # a prefix this share of its home's KV or larger gets the whole term; smaller, in proportion


def reusable_tokens(shared: float, prompt_tokens: int, block_tokens: int) -> float:
    """Of `shared` tokens a prompt has in common with what an engine holds, the ones the engine reuses: whole KV
    blocks of `block_tokens` (0: to the token), never the prompt's last token (vLLM computes at least one).

        reusable = floor(min(shared, prompt - 1) / block) x block
    """
    n = min(shared, prompt_tokens - 1.0)
    if n <= 0:
        return 0.0
    return float(int(n // block_tokens) * block_tokens) if block_tokens > 1 else n


def home_term(cached: float, prompt_tokens: int, kv_capacity_tokens: float) -> float:
    """The score taken off a prefix's home for a prompt with `cached` tokens expected cached there (see above):

        HOME_STAY x cached / prompt x min(1, cached / (HOME_CACHE_SHARE x capacity))   (capacity unknown: x 1)
    """
    if cached <= 0 or prompt_tokens <= 0:
        return 0.0
    size = cached / (HOME_CACHE_SHARE * kv_capacity_tokens) if kv_capacity_tokens > 0 else 1.0
    return HOME_STAY * cached / prompt_tokens * min(1.0, size)


@dataclass(slots=True)
class _Tally:
    """One replica: predictions since the last scrape, the decayed sums of predictions and hits, the confidence."""

    predicted: float = 0.0    # predicted cached tokens placed since the last scrape
    predicted_sum: float = 0.0
    hits_sum: float = 0.0
    last_hits: float = -1.0   # the engine's hits counter at the last scrape taken (-1: none)
    at: float = 0.0           # scraped_at of that scrape
    confidence: float = 0.0


class PrefixAffinity:
    """Per pool: prefix level hashes -> replicas they were placed on, and each replica's confirmed hit share."""

    def __init__(self) -> None:
        self.where: OrderedDict[int, dict[Replica, float]] = OrderedDict()
        self.tally: dict[str, _Tally] = {}
        # level hash -> replica -> requests in flight there whose prompt carries that level (its KV is held)
        self.held: dict[int, dict[Replica, int]] = {}
        # Moves whenever `cached_tokens` could answer differently (a placement recorded, a scrape compared): a
        # caller may keep an answer while it stays the same (`Placer.cached_tokens`).
        self.version = 0

    # ---- the hot path ------------------------------------------------------------------------------------
    def cached_tokens(self, req: LLMRequest) -> dict[Replica, float]:
        """Per replica, the prompt tokens expected cached there: confidence x the longest level it holds, in whole
        blocks (`reusable_tokens`)."""
        chain = req.prefix_chain
        if not chain or not self.where or not req.prompt_chars:
            return {}
        per_char = req.prompt_tokens / req.prompt_chars
        out: dict[Replica, float] = {}
        where = self.where
        for i in range(len(chain) - 1, -1, -1):
            placed = where.get(chain[i])
            if placed is None:
                continue
            latest = next(reversed(placed))
            for r in placed:
                if r not in out:
                    t = self.tally.get(r.address)
                    if t is not None and t.confidence > 0:
                        shared = reusable_tokens(PREFIX_LADDER[i] * per_char, req.prompt_tokens, r.kv_block_tokens)
                        out[r] = t.confidence * shared * (1.0 if r is latest else OLDER_HOLDER)
        return out

    def home(self, req: LLMRequest) -> Replica | None:
        """The replica the longest level of `req`'s prefix placed anywhere was placed on last (None: no level)."""
        chain = req.prefix_chain
        where = self.where
        if not chain or not where:
            return None
        for i in range(len(chain) - 1, -1, -1):
            placed = where.get(chain[i])
            if placed:
                return next(reversed(placed))
        return None

    def held_tokens(self, req: LLMRequest) -> dict[Replica, float]:
        """Per replica, the prompt tokens its requests in flight already hold in KV: confidence x the longest level
        of `req`'s prefix carried by one of them, in whole blocks (0 / absent: none, or no confirmed prefix cache
        there)."""
        chain = req.prefix_chain
        held = self.held
        if not chain or not held or not req.prompt_chars:
            return {}
        per_char = req.prompt_tokens / req.prompt_chars
        out: dict[Replica, float] = {}
        for i in range(len(chain) - 1, -1, -1):
            on = held.get(chain[i])
            if on is None:
                continue
            for r in on:
                if r not in out:
                    t = self.tally.get(r.address)
                    if t is not None and t.confidence > 0:
                        out[r] = t.confidence * reusable_tokens(PREFIX_LADDER[i] * per_char, req.prompt_tokens,
                                                                r.kv_block_tokens)
        return out

    def hold(self, r: Replica, req: LLMRequest) -> None:
        """`req` is in flight on `r`: every level of its prefix is held in that engine's KV until `release`."""
        held = self.held
        for h in req.prefix_chain:
            on = held.get(h)
            if on is None:
                held[h] = {r: 1}
            else:
                on[r] = on.get(r, 0) + 1

    def release(self, r: Replica, req: LLMRequest) -> None:
        """`req` left `r` (finished, cancelled or moved): its levels are held there by one request fewer."""
        held = self.held
        for h in req.prefix_chain:
            on = held.get(h)
            if on is None or r not in on:
                continue  # placed before a reload replaced this tracker
            n = on[r] - 1
            if n > 0:
                on[r] = n
            else:
                del on[r]
                if not on:
                    del held[h]

    def record(self, r: Replica, req: LLMRequest, predicted: float, now: float) -> None:
        """`req` was placed on `r`, where `predicted` tokens of its prompt were expected cached (unweighted by
        confidence): every level of its prefix is now there too."""
        t = self.tally.get(r.address)
        if t is None:
            t = self.tally[r.address] = _Tally()
        t.predicted += predicted
        self.version += 1
        self.hold(r, req)
        where = self.where
        for h in req.prefix_chain:
            placed = where.get(h)
            if placed is None:
                where[h] = {r: now}
                continue
            where.move_to_end(h)
            placed.pop(r, None)
            placed[r] = now
            if len(placed) > KEEP:
                del placed[next(iter(placed))]  # the least recent placement
        while len(where) > MAX_ENTRIES:
            where.popitem(last=False)

    def predicted_tokens(self, r: Replica, req: LLMRequest) -> float:
        """Unweighted by confidence: the longest level of `req`'s prefix placed on `r` before, in tokens, x
        OLDER_HOLDER when `r` is not its latest holder (the credit `cached_tokens` gives it; 0: none)."""
        chain = req.prefix_chain
        if not chain or not req.prompt_chars:
            return 0.0
        for i in range(len(chain) - 1, -1, -1):
            placed = self.where.get(chain[i])
            if placed is not None and r in placed:
                credit = 1.0 if r is next(reversed(placed)) else OLDER_HOLDER
                level_tokens = PREFIX_LADDER[i] * req.prompt_tokens / req.prompt_chars
                return credit * reusable_tokens(level_tokens, req.prompt_tokens, r.kv_block_tokens)
        return 0.0

    # ---- the engines' counters ---------------------------------------------------------------------------
    def on_scrape(self, replicas: list[Replica]) -> None:
        """Add each engine's new prefix-cache hits; compare with the predictions once there are enough. Hits
        while nothing is predicted belong to prefixes this sidecar does not follow and are not counted."""
        self.version += 1
        for r in replicas:
            e = r.engine
            t = self.tally.get(r.address)
            if t is None:
                t = self.tally[r.address] = _Tally()
            if e.scraped_at <= t.at:
                continue
            t.at = e.scraped_at
            total = getattr(e, "prefix_hits_total", -1.0)
            if total < 0:
                t.last_hits = -1.0  # not exported
                continue
            if t.last_hits < 0 or total < t.last_hits or getattr(e, "restarted", False):
                if t.last_hits >= 0:  # the engine restarted: its cache is empty
                    t.confidence, t.predicted_sum, t.hits_sum = 0.0, 0.0, 0.0
                t.last_hits, t.predicted = total, 0.0
                continue
            delta, t.last_hits = total - t.last_hits, total
            if t.predicted <= 0 and t.predicted_sum <= 0:
                continue  # nothing predicted yet: the hits are of prefixes this sidecar does not follow
            keep = 0.5 ** (t.predicted / HALF_EVIDENCE)
            t.predicted_sum = t.predicted_sum * keep + t.predicted
            t.hits_sum = min(t.hits_sum * keep + delta, SURPLUS * t.predicted_sum)
            t.predicted = 0.0
            if t.predicted_sum >= MIN_EVIDENCE:
                t.confidence = min(1.0, t.hits_sum / t.predicted_sum)

    def confidence(self, r: Replica) -> float:
        t = self.tally.get(r.address)
        return t.confidence if t is not None else 0.0
