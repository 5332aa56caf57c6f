"""The `pools[].discovery` part of the policy file: how a pool's replicas by name are followed."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.schema import positive, require


@dataclass(frozen=True, slots=True)
class DnsEntry:
    """A replica entry that stands for every address a name resolves to."""

    dns: str                          # `name:port`: every address the name resolves to is a replica (a headless
                                      # Service, a compose service scaled to N)


@dataclass(frozen=True, slots=True)
class KubernetesSource:
    """The pods an InferencePool selects (extproc/discovery/kubernetes.py; needs the `[k8s]` extra)."""

    namespace: str                    # the InferencePool's namespace
    inference_pool: str               # the InferencePool's name: its Ready pods x targetPorts are the replicas
    watch_timeout_s: int = 60         # a watch ends after this many seconds and the pool object is read again (a
                                      # changed selector or port list takes effect then)

    def validate(self, path: str) -> None:
        require(bool(self.namespace), f"{path}.namespace", "is required")
        require(bool(self.inference_pool), f"{path}.inference_pool", "is required")
        positive(self, path, "watch_timeout_s")


@dataclass(frozen=True, slots=True)
class DiscoveryPolicy:
    """How the pool's names are resolved (extproc/discovery/dns.py), or which InferencePool gives its replicas."""

    interval_s: float = 5.0           # seconds between two resolutions of the pool's names (never on a request's
                                      # path)
    timeout_s: float = 2.0            # a lookup slower than this counts as failed: the name keeps its last addresses
    remove_after: int = 2             # an address is drained after this many successive answers without it (one
                                      # flapping answer does not drain a replica)
    kubernetes: KubernetesSource | None = None  # follow an InferencePool's pods through the Kubernetes API instead
                                                # of names; `replicas` may then be empty

    def validate(self, path: str) -> None:
        positive(self, path, "interval_s", "timeout_s")
        require(self.remove_after >= 1, f"{path}.remove_after", f"must be >= 1, got {self.remove_after!r}")
