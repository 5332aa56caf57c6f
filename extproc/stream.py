"""One ext_proc stream = one HTTP request: its states, the transitions allowed between them, and the holds it
takes on the sidecar's resources.

Modelled on Envoy's ext_proc `ProcessorState`: every state is named (with what it means below), every change
goes through `Stream.move`, which refuses a change the table `TRANSITIONS` does not list:

    NEW ──headers──► HEADERS ──body──► QUEUED ──dispatched──► FORWARDED ──response headers──► RESPONDING
     │ │               │ │                │                   │  │  │                            │   │
     │ │               │ └────────────────┼──── fits now ────►┘  │  └──► DETACHED                │   │
     │ └─ no body, ────┴─► REJECTED ◄─────┘ shed, expired        │       (the access log ends it) │   │
     │    bad key, too many headers                              ├──► CUT ◄─────────────────────┘   │
     └──► PASSED (Envoy's own route answers)                     └──► DONE ◄────────────────────────┘
                                                                      (trailers, the last body chunk)

What a stream holds is a set of `Hold` bits, taken in the order they are declared; `Gateway.finish` releases
them in the reverse order, exactly once (a released hold is cleared), whichever way the stream ended: its
ext_proc stream closed, Envoy's access log reported the end of a detached request, or both.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.admission.queue import Waiter
    from extproc.admission.scheduler import Placement
    from extproc.budgets import Budgets, Charge
    from extproc.head import Head
    from extproc.request import LLMRequest
    from extproc.routing.pool import Pool
    from extproc.streaming import DrainWatch, ResponseObserver


class State(enum.IntEnum):
    """(An IntEnum: hashed and compared in C, where a plain Enum member's hash is a Python call, per transition.)"""

    NEW = 0         # the stream is open; the request headers have not arrived
    HEADERS = 1     # the request headers are read; the buffered body is expected next
    QUEUED = 2      # within every budget, held in its lane's queue until a replica fits it
    FORWARDED = 3   # pinned to a replica and answered; its ext_proc stream stays open for the response
    DETACHED = 4    # pinned; its ext_proc stream ended with the answer, Envoy's access log reports the end
    RESPONDING = 5  # the response headers passed; the body is streaming
    CUT = 6         # the sidecar cuts it (slow consumer): client and replica are reset
    DONE = 7        # the response's end was seen (trailers, or the last body chunk when observed)
    REJECTED = 8    # the sidecar answered it itself (an immediate response); it never reached a replica
    PASSED = 9      # a request without a body for Envoy's own routes (/v1/models), its key valid: Envoy answers it

    @property
    def label(self) -> str:
        return self.name.lower()


TRANSITIONS: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.HEADERS, State.REJECTED, State.PASSED}),
    State.HEADERS: frozenset({State.QUEUED, State.FORWARDED, State.REJECTED}),
    State.QUEUED: frozenset({State.FORWARDED, State.REJECTED}),
    State.FORWARDED: frozenset({State.DETACHED, State.RESPONDING, State.DONE, State.CUT}),
    State.RESPONDING: frozenset({State.DONE, State.CUT}),
    State.DETACHED: frozenset(),
    State.CUT: frozenset(),
    State.DONE: frozenset(),
    State.REJECTED: frozenset(),
    State.PASSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A change of state the table does not allow: a bug in the sidecar, or a message Envoy never sends."""


class Hold:
    """What a stream may hold, one bit each, in the order a stream takes them (plain ints: an IntFlag costs
    about a microsecond per operation, on every request)."""

    OPEN_STREAM = 1 << 0    # counted in sluice_open_streams, from the stream's start to its release
    OPEN_REQUEST = 1 << 1   # one of the sidecar's open-request slots (sidecar.max_open_requests)
    TENANT_STREAM = 1 << 2  # one of its tenant's open streams (tenants.max_streams_per_tenant), and its gauge
    BUDGET = 1 << 3         # the budget charge, settled at release with the actual usage where known
    WAITER = 1 << 4         # its place in a lane's queue
    PLACEMENT = 1 << 5      # its replica slot and its lane's in-flight accounting
    LIVE = 1 << 6           # registered by request id, so a slow consumer can be cut (P13)
    DETACHED = 1 << 7       # registered by request id, released when the access log reports its end

    @classmethod
    def names(cls, holds: int) -> list[str]:
        return [name for name, bit in vars(cls).items() if isinstance(bit, int) and holds & bit]


@dataclass(slots=True, eq=False)
class Stream:
    """One ext_proc stream: where it is, and what it holds (each field set with the hold it belongs to)."""

    state: State = State.NEW
    holds: int = 0                     # Hold bits
    start: float = 0.0
    head: Head | None = None
    req: LLMRequest | None = None
    pool: Pool | None = None
    charge: Charge | None = None       # Hold.BUDGET
    budgets: Budgets | None = None     # the Budgets that issued `charge` (a reload may replace the gateway's)
    waiter: Waiter | None = None       # Hold.WAITER
    placement: Placement | None = None  # Hold.PLACEMENT
    observer: ResponseObserver | None = None  # set when this response's body is observed
    watch: DrainWatch | None = None    # Hold.LIVE: the client's drain rate
    task: asyncio.Task | None = None   # Hold.LIVE: the servicer task, cancelled to cut the stream
    status: int = 0                    # the response's HTTP status, once known
    detached_at: float = 0.0           # Hold.DETACHED: when its ext_proc stream ended (for the sweep)

    def move(self, to: State) -> None:
        """The one way a stream changes state."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.state.label} -> {to.label}")
        self.state = to

    def answered(self, end_of_stream: bool) -> None:
        """The replica's response headers came to a forwarded request: the stream moves on, and its placement
        leaves the replica's awaiting counters (its engine counts it from now on: `Replica.on_scrape`)."""
        self.move(State.DONE if end_of_stream else State.RESPONDING)
        if self.placement is not None and self.req is not None:
            self.placement.on_answer(self.req)

    def take(self, hold: int) -> None:
        """Holds are taken in their declared order, so releasing them in reverse undoes them like a stack (`hold`
        may be several bits taken together)."""
        if self.holds >= hold & -hold:
            raise IllegalTransition(f"hold {Hold.names(hold)} taken while holding {Hold.names(self.holds)}")
        self.holds |= hold

    def drop(self, hold: int) -> bool:
        """Clear a hold; True when it was held (its owner then releases what it stands for)."""
        if self.holds & hold:
            self.holds &= ~hold
            return True
        return False

    @property
    def held(self) -> bool:
        """Envoy was told to wait: the decision follows when the queue dispatches or sheds the request."""
        return self.state is State.QUEUED

    @property
    def ended(self) -> bool:
        """Nothing more passes on this ext_proc stream: the sidecar ends it itself (an RPC the sidecar closes costs
        less than one Envoy cancels, see docs/reliability.md). A detached request's end comes from the access log."""
        return self.state in _ENDED


_ENDED = frozenset({State.DETACHED, State.REJECTED, State.PASSED})
