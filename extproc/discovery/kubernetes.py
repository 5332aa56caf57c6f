"""Endpoints of an InferencePool from the Kubernetes API, reported as the same `EndpointDiff`s as DNS discovery.

Through the official `kubernetes` Python client (`pip install sluice-gateway[k8s]`). Not tested against a live
cluster here: the tests replay recorded API responses (tests/discovery/fixtures/k8s/) through the real client.

What an endpoint is (the InferencePool API, inference.networking.k8s.io/v1):
  the pods of the pool's namespace whose labels match `spec.selector.matchLabels`, that are Ready (condition
  Ready=True), not being deleted (no deletionTimestamp) and have an IP: `podIP:port` for every port of
  `spec.targetPorts` (each port is a distinct endpoint, as the protocol says).

How it follows the cluster: read the InferencePool, list the matching pods, then watch them from the list's
resourceVersion; every event updates the set and a changed set is reported. The watch ends every
`watch_timeout_s` (the pool is then read again: a changed selector or port list takes effect there) or on an
error, after which everything is listed again (410 Gone included). The blocking client runs in a thread of its own;
reports reach the listeners on the event loop.

Failure rule: an API error keeps the last reported set (with `held`); a successful answer is authoritative, even an
empty one (no ready pod: the pool then answers 503, as the protocol requires). Unlike a DNS "no such name", an
empty pod list from the API server is not a hiccup, and a deleted pod's IP may soon belong to another pod.

RBAC needed: get on inferencepools (inference.networking.k8s.io), list and watch on pods, in the pool's namespace
(deploy/k8s/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from extproc.discovery import DiffListener, EndpointDiff, diff_sets, format_address
from extproc.discovery import metrics as dm

log = logging.getLogger("sluice.discovery.kubernetes")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


class InvalidInferencePool(ValueError):
    """The InferencePool object lacks what discovery needs (selector, target ports)."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The fields of an InferencePool that decide its endpoints, and its failure mode."""

    match_labels: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]
    failure_mode: str = "FailClose"  # endpointPickerRef.failureMode: what the gateway (and sluice, when it cannot
                                     # decide) does without a pick

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> "PoolSpec":
        spec = obj.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or [] if "number" in p)
        if not labels or not ports:
            name = (obj.get("metadata") or {}).get("name", "?")
            raise InvalidInferencePool(f"InferencePool {name}: spec.selector.matchLabels and spec.targetPorts "
                                       "are required")
        failure_mode = (spec.get("endpointPickerRef") or {}).get("failureMode") or "FailClose"
        return cls(tuple(sorted((str(k), str(v)) for k, v in labels.items())), ports, str(failure_mode))

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.match_labels)

    def selects(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(labels.get(k) == v for k, v in self.match_labels)


def _ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pod_endpoints(pod: Mapping[str, Any], spec: PoolSpec) -> set[str]:
    """`podIP:port` for each target port of a Ready, live, selected pod; empty otherwise."""
    meta = pod.get("metadata") or {}
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or meta.get("deletionTimestamp") or not spec.selects(meta.get("labels")) or not _ready(pod):
        return set()
    return {format_address(ip, port) for port in spec.target_ports}


def pool_endpoints(pods: Iterable[Mapping[str, Any]], spec: PoolSpec) -> frozenset[str]:
    out: set[str] = set()
    for pod in pods:
        out |= pod_endpoints(pod, spec)
    return frozenset(out)


def default_api_client() -> Any:
    """In-cluster credentials (the pod's ServiceAccount), else the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class KubernetesDiscovery:
    """Follows one InferencePool for one sluice pool. `await start()` lists once (the first diff is returned)
    and keeps watching in a thread; `stop()` ends it."""

    def __init__(self, pool: str, namespace: str, inference_pool: str, api_client: Any = None, *,
                 watch_timeout_s: int = 60, min_backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        from kubernetes import client

        self.pool = pool
        self.namespace = namespace
        self.inference_pool = inference_pool
        self.api = api_client if api_client is not None else default_api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.watch_timeout_s = watch_timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.listeners: list[DiffListener] = []
        self.spec: PoolSpec | None = None
        self.held = False
        self._reported: frozenset[str] | None = None
        self._metrics = dm.pool_metrics(pool)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None

    # ---- API calls (blocking: run in the discovery thread, or via to_thread) ------------------------------
    def read_pool(self) -> PoolSpec:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.inference_pool)
        return PoolSpec.from_object(obj)

    def list_pods(self, spec: PoolSpec) -> tuple[dict[str, dict[str, Any]], str]:
        """The selected pods by name, and the list's resourceVersion to watch from."""
        resp = self.core.list_namespaced_pod(self.namespace, label_selector=spec.label_selector,
                                             _preload_content=False, _request_timeout=10)
        data = json.loads(resp.data)
        pods = {p["metadata"]["name"]: p for p in data.get("items") or []}
        return pods, data["metadata"]["resourceVersion"]

    def _watch_pods(self, spec: PoolSpec, pods: dict[str, dict[str, Any]], version: str) -> None:
        from kubernetes import watch

        self._watch = w = watch.Watch()
        stream = w.stream(self.core.list_namespaced_pod, self.namespace, label_selector=spec.label_selector,
                          resource_version=version, timeout_seconds=self.watch_timeout_s,
                          allow_watch_bookmarks=True, _request_timeout=self.watch_timeout_s + 10)
        for event in stream:
            if self._stopping.is_set():
                break
            kind, obj = event["type"], event["raw_object"]
            name = (obj.get("metadata") or {}).get("name")
            if kind == "BOOKMARK" or not name:
                continue
            if kind == "DELETED":
                pods.pop(name, None)
            else:  # ADDED, MODIFIED
                pods[name] = obj
            self._post(pool_endpoints(pods.values(), spec))

    # ---- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        from kubernetes.client.rest import ApiException

        backoff = self.min_backoff_s
        while not self._stopping.is_set():
            try:
                spec = self.spec = self.read_pool()
                pods, version = self.list_pods(spec)
                self._metrics.lookups[dm.OK].inc()
                self._post(pool_endpoints(pods.values(), spec))
                backoff = self.min_backoff_s
                self._watch_pods(spec, pods, version)
            except ApiException as exc:
                if exc.status == 410:  # the watch's resourceVersion is too old: list again at once
                    continue
                self._failed(exc)
            except Exception as exc:  # connection refused, timeouts, a malformed object: keep the last set
                self._failed(exc)
            else:
                continue
            self._stopping.wait(backoff)
            backoff = min(self.max_backoff_s, backoff * 2)

    def _failed(self, exc: BaseException) -> None:
        if self._stopping.is_set():
            return
        self._metrics.lookups[dm.FAILED].inc()
        log.warning("InferencePool %s/%s: %r; keeping the last endpoints", self.namespace, self.inference_pool,
                    exc)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._hold)

    def _post(self, endpoints: frozenset[str]) -> None:
        if self._loop is not None and not self._stopping.is_set():
            self._loop.call_soon_threadsafe(self._report, endpoints)

    # ---- on the event loop --------------------------------------------------------------------------------
    def _hold(self) -> None:
        self.held = self._reported is not None
        self._metrics.held.set(1 if self.held else 0)

    def _report(self, endpoints: frozenset[str]) -> None:
        before = self._reported
        self._reported = endpoints
        self.held = False
        diff = diff_sets(self.pool, before or frozenset(), endpoints, initial=before is None)
        self._metrics.report(len(endpoints), len(diff.added), len(diff.removed), False)
        if not diff and before is not None:
            return
        if before is not None:
            log.info("pool %s: InferencePool %s +%s -%s", self.pool, self.inference_pool, list(diff.added),
                     list(diff.removed))
        for listener in self.listeners:
            listener(diff)

    def snapshot(self) -> frozenset[str]:
        return self._reported or frozenset()

    @property
    def snapshot_known(self) -> bool:
        """Has the API answered once (the pool's endpoints are known, possibly none)?"""
        return self._reported is not None

    async def start(self, first_timeout_s: float = 10.0) -> EndpointDiff | None:
        """Start following the pool; wait (up to `first_timeout_s`) for the first report and return it (None if
        the API did not answer in time: the pool starts empty and fills when it does)."""
        self._loop = asyncio.get_running_loop()
        first: asyncio.Future[EndpointDiff] = self._loop.create_future()

        def once(diff: EndpointDiff) -> None:
            if not first.done():
                first.set_result(diff)

        self.listeners.insert(0, once)
        self._thread = threading.Thread(target=self._run, name=f"sluice-k8s-{self.pool}", daemon=True)
        self._thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(first), first_timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            self.listeners.remove(once)

    async def stop(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
