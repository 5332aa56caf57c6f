"""`python -m bench.hop_cost`: the sidecar's own Python work per request, without gRPC.

Drives one `Gateway` in process the way the servicer and the access-log receiver do: parse the request headers
and the buffered body from their wire bytes, decide, serialise the answers, then hand it the access-log entry
that ends the request. The CPU time per request (time.process_time) is what the sidecar's code adds on top of
grpc.aio's own per-stream work, which `sluice bench overhead` measures together with it. Run it under the CPU
lock; repeat it (`--rounds`) and read the lowest round, the one least disturbed by other processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.accesslog import AccessLogReceiver
from extproc.config import policy_from_dict
from extproc.gateway import Gateway

MODEL = "hop-m"
HEADERS = [(":authority", "127.0.0.1:8080"), (":path", "/v1/chat/completions"), (":method", "POST"),
           (":scheme", "http"), ("content-type", "application/json"), ("user-agent", "Python/3.11 aiohttp"),
           ("accept", "*/*"), ("accept-encoding", "gzip, deflate"), ("x-forwarded-proto", "http")]


def _wire(i: int, body: bytes) -> tuple[bytes, bytes, bytes]:
    """The three messages of request `i` as Envoy sends them: headers, buffered body, access-log end."""
    request_id = f"{i:08x}-0000-4000-8000-000000000000"
    headers = HEADERS + [("content-length", str(len(body))), ("x-request-id", request_id)]
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])))
    msg = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    end = al.HTTPAccessLogEntry()
    end.request.request_id = request_id
    end.response.response_code.value = 200
    end.common_properties.upstream_cluster = "pool-" + MODEL
    return head.SerializeToString(), msg.SerializeToString(), end.SerializeToString()


async def _round(gw: Gateway, receiver: AccessLogReceiver,
                 wire: list[tuple[bytes, bytes, bytes]]) -> tuple[float, int]:
    """CPU seconds per request over `wire`, and how many requests were forwarded (pinned)."""
    forwarded = 0
    t0 = time.process_time()
    for head_b, body_b, end_b in wire:
        st = gw.open_stream()
        gw.on_request_headers(st, pb.ProcessingRequest.FromString(head_b).request_headers).SerializeToString()
        answer = await gw.on_request_body(st, pb.ProcessingRequest.FromString(body_b).request_body)
        answer.SerializeToString()
        if st.held:
            answer = await gw.wait(st)
            answer.SerializeToString()
        forwarded += answer.HasField("request_body")
        gw.close(st)
        receiver.handle(al.HTTPAccessLogEntry.FromString(end_b))
    return (time.process_time() - t0) / len(wire), forwarded


def run(requests: int, rounds: int) -> dict:
    gw = Gateway(policy_from_dict({"pools": [{"model": MODEL, "replicas": ["127.0.0.1:9"], "metrics_style": "none"}],
                                   "simulator": {"enabled": False}}))
    receiver = AccessLogReceiver({p.cluster: p.model for p in gw.pools.values()})
    gw.attach_access_log(receiver)
    body = orjson.dumps({"model": MODEL, "max_tokens": 1,
                         "messages": [{"role": "user", "content": "hello there, how are you"}]})
    per_round, forwarded = [], 0
    for r in range(rounds):
        wire = [_wire(r * requests + i, body) for i in range(requests)]
        seconds, n = asyncio.run(_round(gw, receiver, wire))
        per_round.append(seconds * 1e6)
        forwarded += n
    return {"us_per_request_min": min(per_round), "us_per_request_rounds": per_round, "requests": requests,
            "forwarded": forwarded, "open_requests_left": gw.open_requests}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hop_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.requests, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
