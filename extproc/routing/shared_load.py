"""Several gateways as one: each sidecar publishes its requests in flight per replica to Redis and reads the other
sidecars' fresh reports, so placement sees the pool's whole in-flight load, not only its own, between scrapes.

Why: a replica's scraped numbers (KV usage, engine queue) include every gateway's requests, but only as of the
last scrape (200 ms). Between scrapes each sidecar adds its own placements exactly; without this view it is blind
to the other gateways' placements, so under a burst N gateways pile onto the same replica that looked emptiest.

Protocol (one Redis round trip per `interval_s`, never per request; off the hot path in a background task):
  one hash per deployment, `<key_prefix>load`: field = sidecar id, value = `<redis time ms>|<json>` with
  json = {pool: {replica: [tokens, requests, growth, output]}} of that sidecar's requests in flight (non-zero
  entries only; tokens = their footprints, prompt + expected output; growth = the output they are still expected
  to decode, admission/kv_growth.py; output = the expected output within tokens, so tokens - output are their
  prompts; a report without growth or output counts 0 for it).
  A Lua script writes this sidecar's field (stamped with Redis' own clock: no skew between gateways), refreshes
  the key's TTL, and returns Redis' clock, then the id and report of every other field younger than
  `stale_after_s`; fields older than 10 x that are deleted (sidecars that died). A sidecar that stops publishing
  drops out of the others' view within `stale_after_s`: its load is then visible only through scrapes.

What placement adds (`Load` per replica, from `others()`; the Fleet copies it onto each `Replica`, and
admission/placement.py `Placer.kv_committed` and `_over_concurrency` read it):
  never scraped    own in-flight tokens + others' in-flight tokens (the reservations)
  between scrapes  others' in-flight growth since this sidecar last scraped the replica, on top of the engine's
                   numbers: since = max(0, others_now - others_at_scrape)  (what the scrape cannot have seen yet);
                   in full footprints for `kv_held`, in prompts (tokens - output) for `kv_committed`, whose growth
                   term counts their outputs
  concurrency      with an explicit or unknown cap: own in-flight requests + others' in-flight requests
  growth           the others' requests' expected output still to decode, next to this sidecar's own: the KV
                   they will hold before they end, which no scrape shows yet (placement `kv_committed`)
The view is at most `interval_s` + one round trip old; queues stay local (each sidecar admits its own requests).
With `take_turns`, between two views each sidecar fills only its share of a replica's headroom, the rest in turn
(turns.py `Turns`, updated here with Redis' clock and which sidecars have requests in flight in each pool).

Losing Redis: any error empties the view (placement falls back to own placements + scrapes, today's behaviour),
sets `sluice_shared_load_degraded`, logs once, and retries with exponential backoff (interval_s doubling up to
`max_backoff_s`); the first successful round trip restores the view by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import orjson

from extproc.routing import metrics as rm
from extproc.routing.policy import SharedLoadPolicy
from extproc.routing.turns import Turns

log = logging.getLogger("sluice.routing.shared_load")
STOP_WAIT_S = 2.0  # how long stop() waits for the loop to end and for the client to close

LocalView = Callable[[], Mapping[str, Mapping[str, tuple[int, ...]]]]
"""This sidecar's requests in flight: pool -> replica address -> (tokens, requests, output still to decode,
expected output within tokens)."""

View = dict[str, dict[str, "Load"]]

_SYNC_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], now .. '|' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], stale * 10)
local all = redis.call('HGETALL', KEYS[1])
local out = {now}
for i = 1, #all, 2 do
  local id, v = all[i], all[i + 1]
  if id ~= ARGV[1] then
    local sep = string.find(v, '|', 1, true)
    local ts = sep and tonumber(string.sub(v, 1, sep - 1))
    if ts and ts >= now - stale then
      out[#out + 1] = id
      out[#out + 1] = string.sub(v, sep + 1)
    elseif not ts or ts < now - stale * 10 then
      redis.call('HDEL', KEYS[1], id)
    end
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Load:
    """Requests in flight on one replica, their reserved tokens (prompt + expected output), the output they
    are still expected to decode, and their expected output (`tokens - output`: their prompts)."""

    tokens: int = 0
    requests: int = 0
    growth: int = 0
    output: int = 0


ZERO = Load()


def redis_client(url: str, timeout_s: float = 0.05) -> Any:
    """A redis.asyncio client for the view: short timeouts, no client-side retries (a failed round trip is simply
    the next interval's problem), at most two connections."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=2, timeout=timeout_s, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), retry_on_error=[], health_check_interval=0)
    return aioredis.Redis(connection_pool=pool)


def _encode(local: Mapping[str, Mapping[str, tuple[int, ...]]]) -> bytes:
    return orjson.dumps({pool: {addr: list(load) for addr, load in replicas.items() if load[0] or load[1]}
                         for pool, replicas in local.items()})


def _merge(reports: list[bytes], ids: list[str] | None = None,
           active: dict[str, set[str]] | None = None) -> View:
    """Sum the other sidecars' reports per pool and replica (a malformed report is skipped). With `ids` (each
    report's sidecar) and `active`, also note per pool the sidecars with requests in flight there."""
    tokens: dict[tuple[str, str], list[int]] = {}
    for i, raw in enumerate(reports):
        try:
            report = orjson.loads(raw)
            for pool, replicas in report.items():
                if active is not None and ids is not None and any(int(load[1]) for load in replicas.values()):
                    active.setdefault(pool, set()).add(ids[i])
                for addr, load in replicas.items():
                    acc = tokens.setdefault((pool, addr), [0, 0, 0, 0])
                    acc[0] += int(load[0])
                    acc[1] += int(load[1])
                    acc[2] += int(load[2]) if len(load) > 2 else 0
                    acc[3] += int(load[3]) if len(load) > 3 else 0
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError, IndexError, KeyError):
            log.debug("skipped a malformed shared-load report")
    view: View = {}
    for (pool, addr), (t, r, g, o) in tokens.items():
        view.setdefault(pool, {})[addr] = Load(t, r, g, o)
    return view


class SharedLoad:
    """The shared in-flight view of one sidecar. `listeners` are called with the new view after every round trip
    (and with an empty view when Redis is lost), on the event loop."""

    def __init__(self, client: Any, sidecar_id: str, local_view: LocalView,
                 policy: SharedLoadPolicy | None = None, key: str = "sluice:load") -> None:
        self.client = client
        self.sidecar_id = sidecar_id
        self.local_view = local_view
        self.policy = policy or SharedLoadPolicy()
        self.key = key  # the Redis hash every sidecar of one deployment shares
        self._script = client.register_script(_SYNC_LUA)
        self.turns = Turns(sidecar_id, self.policy.interval_s)  # whose turn the last places are (turns.py)
        self.view: View = {}
        self.peers = 0
        self.degraded = False
        self._delay = self.policy.interval_s
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[View], None]] = []

    # ---- what placement reads (plain dict lookups: safe on the hot path) -------------------------------------
    def others(self, pool: str, replica: str) -> Load:
        """The other sidecars' fresh in-flight load on the replica (zero without a shared view)."""
        return self.view.get(pool, {}).get(replica, ZERO)

    # ---- one round trip ---------------------------------------------------------------------------------
    async def sync_once(self) -> bool:
        """Publish this sidecar's load and read the others'. False (view emptied, degraded) on any Redis error."""
        p = self.policy
        try:
            payload = _encode(self.local_view())
            reply = await self._script(keys=[self.key],
                                       args=[self.sidecar_id, payload, int(p.stale_after_s * 1000)])
            redis_ms = float(reply[0])
        except Exception as exc:  # redis errors, timeouts, connection refused: all mean "no shared view now"
            self._lose(exc)
            return False
        ids = [i.decode(errors="replace") if isinstance(i, bytes) else str(i) for i in reply[1::2]]
        active: dict[str, set[str]] = {}
        self.view = _merge(reply[2::2], ids, active)
        self.turns.update(redis_ms, active)
        self.peers = len(ids)
        rm.SHARED_LOAD_PEERS.set(self.peers)
        if self.degraded:
            self.degraded = False
            rm.SHARED_LOAD_DEGRADED.set(0)
            log.warning("shared in-flight view restored (%d other sidecars)", self.peers)
        self._delay = p.interval_s
        self._notify()
        return True

    def _lose(self, exc: BaseException) -> None:
        rm.SHARED_LOAD_SYNC_FAILURES.inc()
        if not self.degraded:
            self.degraded = True
            rm.SHARED_LOAD_DEGRADED.set(1)
            log.warning("shared in-flight view lost (%r): placing on own placements and scrapes only", exc)
        self._delay = min(self.policy.max_backoff_s, self._delay * 2)
        self.turns.clear()
        self.peers = 0
        rm.SHARED_LOAD_PEERS.set(0)
        if self.view:
            self.view = {}
            self._notify()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener(self.view)

    # ---- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.sync_once()
        self._task = asyncio.create_task(self._run(), name="sluice-shared-load")

    async def _run(self) -> None:
        while True:  # sequential: never more than one round trip in flight
            await asyncio.sleep(self._delay)
            try:
                await self.sync_once()
            except Exception:  # a listener's bug must not stop the view
                log.exception("shared load round failed")

    async def stop(self) -> None:
        """Cancel the loop and close the client, each within STOP_WAIT_S: a round trip stuck in the Redis client
        (a connection pool that does not give up under a Redis kill) must not hold the sidecar's shutdown."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            _, stuck = await asyncio.wait({task}, timeout=STOP_WAIT_S)
            if stuck:
                log.warning("shared load round still running %.0f s after its cancel: left behind", STOP_WAIT_S)
        close = asyncio.ensure_future(self.client.aclose(close_connection_pool=True))
        await asyncio.wait({close}, timeout=STOP_WAIT_S)
        if close.done() and not close.cancelled():
            close.exception()  # retrieved, not raised: closing a broken connection must not fail shutdown


class SharingFleet(Protocol):
    """What the shared view needs of a sidecar's Fleet (extproc/fleet.py)."""

    def local_view(self) -> Mapping[str, Mapping[str, tuple[int, ...]]]: ...
    def on_shared_view(self, view: View) -> None: ...
    def share_turns(self, turns: Turns) -> None: ...


def shared_load_from_policy(policy: Any, worker: int, fleet: SharingFleet) -> SharedLoad | None:
    """The shared view a policy asks for (`routing.shared_load.enabled` with `budgets.store.kind: redis`, through
    the budgets' Redis under their key prefix), wired to `fleet` (its load published, the others' delivered, and
    with `take_turns` its placers' turns) and not started; None when there is nothing to share with."""
    store = policy.budgets.store
    if store.kind != "redis" or not policy.routing.shared_load.enabled:
        return None
    client = redis_client(store.redis.url, timeout_s=max(store.redis.socket_timeout_s, 0.05))
    sidecar_id = f"{socket.gethostname()}:{os.getpid()}:{worker}"
    shared = SharedLoad(client, sidecar_id, fleet.local_view, policy.routing.shared_load,
                        key=f"{store.redis.key_prefix}load")
    shared.listeners.append(fleet.on_shared_view)
    if policy.routing.shared_load.take_turns:
        fleet.share_turns(shared.turns)
    return shared
