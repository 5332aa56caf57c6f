"""free_ports: ports for test and bench stacks, distinct across calls of one process."""

from __future__ import annotations

from extproc.supervisor import _ephemeral_low, free_ports


def test_successive_calls_never_hand_out_a_port_twice_before_it_is_bound():
    # nothing binds these ports: a stack that has not started yet must not share one with the next stack
    batches = [free_ports(10) for _ in range(50)]
    ports = [p for batch in batches for p in batch]
    assert len(ports) == len(set(ports)) == 500
    assert all(1024 <= p < _ephemeral_low() for p in ports)
