"""Where budget state lives (`budgets.store.kind`): in this process (memory_store.py) or in Redis, shared by every
sidecar (redis_store.py, with the memory store as its fallback). Both take the same typed operations (ops.py):
`admit(AdmitOp) -> AdmitResult` (every check, then every charge, or nothing) and `settle(SettleOp)`; the memory
store also answers synchronously (`admit_sync` / `settle_sync`: it never waits on I/O).
"""

from __future__ import annotations

from extproc.budgets.memory_store import MemoryStore
from extproc.budgets.policy import StorePolicy
from extproc.budgets.redis_store import RedisStore

Store = MemoryStore | RedisStore


def make_store(policy: StorePolicy, share: float) -> Store:
    """The store of `policy.kind`; `share` is this sidecar's share of each global limit when it enforces alone."""
    if policy.kind == "redis":
        return RedisStore(policy.redis, fallback_share=share)
    return MemoryStore(share=share)
