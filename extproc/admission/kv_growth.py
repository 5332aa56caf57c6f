"""The KV a replica's requests in flight will still grow into: the output they have yet to decode (P9, PG).

A scrape shows what an engine holds now. A long generation that started a moment ago shows its prompt only, yet
it will hold prompt + output before it ends: admission that counts only what is held now lets the gateways fill
the engine with prompts whose outputs then do not fit, and the engine preempts (P9; PG with several gateways).
A reservation of the whole footprint for the request's whole life is wrong the other way: a stream whose client
reads slowly holds nothing in an engine that has finished it (P13). What is still to come is the difference:

    remaining_i(t) = max(0, end_i - t) / d_i         end_i = first token_i + expected output_i x d_i

with d_i the pool's decode seconds per token and the first token the placer's prediction, both when the request
was placed; the expected output is the client's max_tokens, else the app's learned p90 (output_length.py). Before
its first token a request counts (first token_i - t) / d_i more than its output: at most its predicted TTFT's
worth of decode steps, on the safe side.

    growth(t) = sum over live i with end_i > t of remaining_i(t) = sum(end_i / d_i) - t x sum(1 / d_i)

kept as two running sums and a heap by end_i, so a placement's check is O(1) amortised whatever the number of
requests in flight (P12 runs hundreds per replica): entries whose end passed are popped on the next read, a
request that ends earlier (its stream finished or was cut) leaves at once.
"""

from __future__ import annotations

import heapq

COMPACT_MIN = 64  # removed entries tolerated in the heap before a rebuild is considered


class Growth:
    """One request's entry: when its decode is predicted to end, 1 / its decode time per token, and whether it
    still counts."""

    __slots__ = ("end", "per_s", "live")

    def __init__(self, end: float, per_s: float) -> None:
        self.end = end
        self.per_s = per_s
        self.live = True

    def __lt__(self, other: "Growth") -> bool:
        return self.end < other.end


class KvGrowth:
    """Per replica, this sidecar's requests in flight on it. Pure arithmetic: no I/O."""

    __slots__ = ("_heap", "_ends", "_rates", "_dead")

    def __init__(self) -> None:
        self._heap: list[Growth] = []
        self._ends = 0.0   # sum of end_i / d_i over the counted entries
        self._rates = 0.0  # sum of 1 / d_i over the counted entries
        self._dead = 0     # entries removed before their end, still in the heap

    def add(self, first_token_at: float, output_tokens: float, decode_s: float) -> Growth:
        """A request placed here that will decode `output_tokens` from `first_token_at` at `decode_s` per token."""
        g = Growth(first_token_at + output_tokens * decode_s, 1.0 / decode_s)
        heapq.heappush(self._heap, g)
        self._ends += g.end * g.per_s
        self._rates += g.per_s
        return g

    def remove(self, g: Growth) -> None:
        """The request ended (or moved away): its growth stops counting now. Its entry leaves the heap when its end
        passes, or when removed entries outnumber the counted ones (the heap is rebuilt: bounded by the requests
        in flight)."""
        if not g.live:
            return
        self._drop(g)
        self._dead += 1
        heap = self._heap
        if self._dead > COMPACT_MIN and 2 * self._dead > len(heap):
            self._heap = [e for e in heap if e.live]
            heapq.heapify(self._heap)
            self._dead = 0

    def _drop(self, g: Growth) -> None:
        g.live = False
        self._ends -= g.end * g.per_s
        self._rates -= g.per_s

    def remaining(self, now: float) -> float:
        """Output tokens the counted requests are still expected to decode here."""
        heap = self._heap
        while heap and heap[0].end <= now:
            g = heapq.heappop(heap)
            if g.live:
                self._drop(g)
            else:
                self._dead -= 1
        if not heap:
            self._ends = self._rates = 0.0  # no rounding drift carried over
            return 0.0
        left = self._ends - now * self._rates
        return left if left > 0 else 0.0

    def within(self, now: float, horizon_s: float) -> float:
        """Output tokens the counted requests are expected to decode in the next `horizon_s` seconds:
        sum over live i of min(end_i - now, horizon_s) / d_i (O(requests in flight): `remaining` first)."""
        total = 0.0
        for g in self._heap:
            if g.live:
                left = g.end - now
                if left > 0:
                    total += (left if left < horizon_s else horizon_s) * g.per_s
        return total

    def __len__(self) -> int:
        return len(self._heap)
