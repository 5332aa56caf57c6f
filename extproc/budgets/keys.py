"""Store key fragments for identities that come from clients (bounded length, no separator clashes)."""

from __future__ import annotations

import hashlib

MAX_ID = 96


def ident(value: str) -> str:
    """A client-supplied id as a key fragment: kept as is when short and plain, else a 128-bit digest."""
    if len(value) <= MAX_ID and ":" not in value and value.isprintable():
        return value
    return "#" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
