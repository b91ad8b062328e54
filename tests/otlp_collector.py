"""A tiny OTLP/HTTP trace collector: real HTTP on 127.0.0.1, the protobuf requests the
OTLP exporter sends decoded into plain dicts. For tests whose spans come from other
processes (a worker killed with SIGKILL), and for the tracing benchmark's
"exporter to a local collector" case."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class CollectedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class Collector:
    """``with Collector() as c:`` ``c.endpoint`` for OTEL_EXPORTER_OTLP_ENDPOINT;
    ``c.spans()`` what arrived so far; ``c.requests`` how many exports."""

    def __init__(self) -> None:
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector._take(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def _take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        found = [
            CollectedSpan(span.name, span.trace_id.hex(), span.span_id.hex(),
                          span.parent_span_id.hex(), _attributes(span.attributes),
                          [(e.name, _attributes(e.attributes)) for e in span.events])
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans]
        with self._lock:
            self._spans.extend(found)
            self.requests += 1

    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    """``python -m tests.otlp_collector``: a collector in a process of its own (the
    tracing benchmark's, whose CPU must not count the collector's): prints its endpoint,
    serves until stdin closes, then prints how many spans it received."""
    import sys

    with Collector() as collector:
        print(collector.endpoint, flush=True)
        sys.stdin.read()
        print(len(collector.spans()), flush=True)


if __name__ == "__main__":
    main()
