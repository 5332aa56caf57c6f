"""The KV a replica's requests in flight will still grow into: the output they have yet to decode (P9, PG).

A scrape shows what an engine holds now. A long generation that started a moment ago shows its prompt only, yet
it will hold prompt + output before it ends: admission that counts only what is held now lets the gateways fill
the engine with prompts whose outputs then do not fit, and the engine preempts (P9; PG with several gateways).
A reservation of the whole footprint for the request's whole life is wrong the other way: a stream whose client
reads slowly holds nothing in an engine that has finished it (P13). What is still to come is the difference:

    remaining_i(t) = out_i                            before its first token (t < first_i)
                   = max(0, end_i - t) / d_i          after it, end_i = first_i + out_i x d_i

with d_i the pool's decode seconds per token and first_i the placer's predicted first token, both when the
request was placed; out_i is the client's max_tokens, else the app's learned p90 (output_length.py).

    growth(t) = sum over pending i of out_i + sum over decoding i of (end_i / d_i) - t x sum(1 / d_i)

kept as running sums and two heaps (pending by first_i, decoding by end_i), so a placement's check is O(1)
amortised whatever the number of requests in flight (P12 runs hundreds per replica): a request moves from pending
to decoding, and leaves when its end passes, on the next read; one that ends earlier (its stream finished or was
cut) leaves the sums at once.

The ledger's timing is a prediction, and the engine may be behind it. It takes a prompt's KV blocks chunk by chunk
as it prefills (vLLM's chunked prefill: at most max_num_batched_tokens per step), so a scrape taken while a long
prompt prefills shows only its computed part, and a prefill slower than predicted leaves the ledger counting output
as decoded that is still to come. Whatever the ledger expects this sidecar's requests to hold when the page was
asked for (s) and the page does not show is still to come:

    unshown(s) = max(0, sum over live i placed before s of (prompt_i + decoded_i(s)) - held(s))

with prompt_i its prompt less the prefix blocks it shares with requests in flight here, decoded_i(s) = min(out_i,
max(0, s - first_i) / d_i), and held(s) the scraped KV usage x capacity (the other sidecars' requests in it only
lower the sum: never counted twice, though with several gateways they can hide what is still to come of this
sidecar's; PG's remaining preemptions come from two gateways taking a replica's last place together instead,
docs/benchmarks.md), plus the prompts of the requests the engine had not counted yet, which the
placer counts as placed since the scrape (`Replica.on_scrape`'s carry). O(requests in flight), so read once per
scrape (the placer keeps it). Without it, P9 with a cache of three long requests preempted: two 3,000-token prompts
placed together, predicted prefilled in 0.3 s at the learned speed, showed 4,280 of their 6,304 tokens at the next
scrape, and a third long one was let in beside them.
"""

from __future__ import annotations

import heapq
from itertools import count
from operator import itemgetter

COMPACT_MIN = 64  # removed entries tolerated in the heaps before a rebuild is considered
_seq = count()     # tie-breaker for heap entries with equal times


END_SLACK = 1.5  # a request's KV counts as freed only after this x its predicted time left (`peak_within`)
START, STOP, FREE = 0, 1, 2  # `peak_within`'s events, in this order at one time: the peak counts them all


def _end_events(events: list[tuple[float, int, "Growth"]], g: "Growth", now: float, until: float) -> None:
    """`g`'s output stops growing at its predicted end and its KV is freed END_SLACK x its time left from now: the
    end is predicted at the decode speed of its placement, and an engine that got busier since decodes slower (a
    free counted early is a preemption; one counted late a request held back)."""
    if g.end < until:
        events.append((g.end, STOP, g))
        freed_at = now + (g.end - now) * END_SLACK
        if freed_at < until:
            events.append((freed_at, FREE, g))


class Growth:
    """One request's entry: its predicted first token and decode end, 1 / its decode time per token, its expected
    output, the KV tokens it holds at its end (footprint: prompt + expected output, which its end frees), and
    whether it still counts (live) and decodes (started)."""

    __slots__ = ("first", "end", "per_s", "out", "tokens", "live", "started", "prompt", "placed")

    def __init__(self, first: float, out: float, decode_s: float, tokens: float = 0.0, prompt: float = 0.0,
                 placed: float = 0.0) -> None:
        self.first = first
        self.end = first + out * decode_s
        self.per_s = 1.0 / decode_s
        self.out = out
        self.tokens = tokens
        self.live = True
        self.started = False
        self.prompt = prompt  # its prompt's KV (less the prefix blocks it shares with requests in flight)
        self.placed = placed  # when it was placed

    def expected_at(self, at: float) -> float:
        """The KV the ledger expects it to hold at `at`: its prompt, and the output decoded by then."""
        decoded = (at - self.first) * self.per_s
        return self.prompt + (0.0 if decoded <= 0 else decoded if decoded < self.out else self.out)


class KvGrowth:
    """Per replica, this sidecar's requests in flight on it. Pure arithmetic: no I/O."""

    __slots__ = ("_pending", "_decoding", "_out", "_ends", "_rates", "_dead")

    def __init__(self) -> None:
        self._pending: list[tuple[float, int, Growth]] = []   # by first token
        self._decoding: list[tuple[float, int, Growth]] = []  # by decode end
        self._out = 0.0    # sum of out_i over the live pending entries
        self._ends = 0.0   # sum of end_i / d_i over the live decoding entries
        self._rates = 0.0  # sum of 1 / d_i over the live decoding entries
        self._dead = 0     # entries removed before their end, still in a heap

    def add(self, first_token_at: float, output_tokens: float, decode_s: float, tokens: float = 0.0,
            prompt: float = 0.0, placed: float = 0.0) -> Growth:
        """A request placed here at `placed` that will decode `output_tokens` from `first_token_at` at `decode_s` per
        token, and hold `tokens` of KV (its footprint, `prompt` of it its prompt's) until its end."""
        g = Growth(first_token_at, output_tokens, decode_s, tokens, prompt, placed)
        heapq.heappush(self._pending, (g.first, next(_seq), g))
        self._out += g.out
        return g

    def remove(self, g: Growth) -> None:
        """The request ended (or moved away): its growth stops counting now. Its entry leaves its heap when its time
        comes, or when removed entries outnumber the counted ones (the heaps are rebuilt: bounded by the requests
        in flight)."""
        if not g.live:
            return
        self._drop(g)
        self._dead += 1
        if self._dead > COMPACT_MIN and 2 * self._dead > len(self._pending) + len(self._decoding):
            self._pending = [e for e in self._pending if e[2].live]
            self._decoding = [e for e in self._decoding if e[2].live]
            heapq.heapify(self._pending)
            heapq.heapify(self._decoding)
            self._dead = 0

    def _drop(self, g: Growth) -> None:
        g.live = False
        if g.started:
            self._ends -= g.end * g.per_s
            self._rates -= g.per_s
        else:
            self._out -= g.out

    def _advance(self, now: float) -> None:
        """Pending entries whose first token is due start decoding; decoding ones whose end passed leave."""
        pending, decoding = self._pending, self._decoding
        while pending and pending[0][0] <= now:
            _, seq, g = heapq.heappop(pending)
            if not g.live:
                self._dead -= 1
                continue
            self._out -= g.out
            g.started = True
            self._ends += g.end * g.per_s
            self._rates += g.per_s
            heapq.heappush(decoding, (g.end, seq, g))
        while decoding and decoding[0][0] <= now:
            g = heapq.heappop(decoding)[2]
            if g.live:
                self._drop(g)
            else:
                self._dead -= 1
        if not decoding:
            self._ends = self._rates = 0.0  # no rounding drift carried over
        if not pending:
            self._out = 0.0

    def remaining(self, now: float) -> float:
        """Output tokens the counted requests are still expected to decode here."""
        self._advance(now)
        left = self._ends - now * self._rates
        return self._out + (left if left > 0 else 0.0)

    def within(self, now: float, horizon_s: float) -> float:
        """Output tokens the counted requests are expected to decode in the next `horizon_s` seconds (O(requests
        in flight): `remaining` first, which bounds it)."""
        self._advance(now)
        until = now + horizon_s
        total = 0.0
        for first, _, g in self._pending:
            if g.live and first < until:
                n = (until - first) * g.per_s
                total += n if n < g.out else g.out
        for end, _, g in self._decoding:
            if g.live:
                total += ((end if end < until else until) - now) * g.per_s
        return total

    def peak_within(self, now: float, horizon_s: float, joining: Growth | None = None) -> float:
        """The most KV the counted requests add to what they hold now at any moment of the next `horizon_s` seconds,
        each one's end freeing what it holds then (`within` with the ends subtracted; `within` bounds it):

            peak     = max over t in [now, now + horizon] of  grown(t) - freed(t)
            grown(t) = sum over i of (min(end_i, t) - max(first_i, now))+ / d_i     output decoded from now to t
            freed(t) = sum over i with free_i < t of (prompt_i + out_i)            what i holds when it ends
            free_i   = now + END_SLACK x (end_i - now)                            its end, with a margin

        `joining`: a request about to be placed whose lifetime is the horizon (not in the ledger): its output decoded
        from its first token on counts in grown(t) as well, so the peak is where the others' growth and frees meet
        its own growth, not its whole output at once.

        grown rises between events and freed falls only at a free, so the peak is just before a free or at the
        horizon: one sweep over the starts and ends in time order, O(n log n) in the requests in flight (read only
        when the whole future does not fit). A long request refused on `within` waits for KV that the short ones
        around it free long before its own output needs it (P9 on real engines: its long requests got 0.67-0.83 of
        the best baseline's goodput)."""
        self._advance(now)
        until = now + horizon_s
        events: list[tuple[float, int, Growth]] = []  # (time, START | STOP | FREE, entry)
        rate = 0.0
        if joining is not None:
            if joining.first <= now:
                rate += joining.per_s
            elif joining.first < until:
                events.append((joining.first, START, joining))
        for first, _, g in self._pending:
            if g.live and first < until:
                events.append((first, START, g))
                _end_events(events, g, now, until)
        for _, _, g in self._decoding:
            if g.live:
                rate += g.per_s
                _end_events(events, g, now, until)
        events.sort(key=itemgetter(0, 1))  # by time, then START, STOP, FREE (entries do not compare)
        grown = freed = peak = 0.0
        at = now
        for t, kind, g in events:
            grown += rate * (t - at)
            at = t
            if kind == START:
                rate += g.per_s
            elif kind == STOP:
                rate -= g.per_s
            else:
                if grown - freed > peak:
                    peak = grown - freed
                freed += g.prompt + g.out
        grown += rate * (until - at)
        return max(peak, grown - freed)

    def unshown(self, at: float, held: float) -> float:
        """`unshown(at)`: what the ledger expects the requests placed before a scrape at `at` to hold and the scrape,
        which showed `held` tokens, does not (O(requests in flight): once per scrape)."""
        expected = 0.0
        for heap in (self._pending, self._decoding):
            for _, _, g in heap:
                if g.live and g.placed < at:
                    expected += g.expected_at(at)
        return expected - held if expected > held else 0.0

    def ends(self, now: float) -> list[tuple[float, float]]:
        """(predicted end, footprint) of each counted request, soonest first: when its end frees its KV
        (O(n log n) in the requests in flight: for a refusal, not for a placement)."""
        self._advance(now)
        out = [(g.end, g.tokens) for _, _, g in self._pending if g.live]
        out += [(g.end, g.tokens) for _, _, g in self._decoding if g.live]
        out.sort()
        return out

    def __len__(self) -> int:
        return len(self._pending) + len(self._decoding)
