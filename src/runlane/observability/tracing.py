"""Traces (OpenTelemetry): one trace per task, from the submit that created it to each
attempt, the attempt's stages and the agent's tool calls (docs/tracing.md).

The submit starts a span per task and stores its W3C ``traceparent`` on the task's row
(``tasks.traceparent``, migration 0022); an attempt, claimed days later on another
machine, reads it with the task and starts its span as that span's child, so every
attempt of a task (a retry after a worker was killed too) lands in the task's trace.
The attempt's context reaches the agent as ``TRACEPARENT``.

Off unless configured: with no exporter named (``OTEL_TRACES_EXPORTER`` unset and no
OTLP endpoint), nothing installs a tracer provider, :func:`enabled` is false, and each
call below returns a shared do-nothing object without touching OpenTelemetry (a stored
``traceparent`` is still handed to the agent). An application that uses runlane as a
library and has set its own global provider gets runlane's spans in it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from runlane.settings import SettingsInvalid

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from runlane.store.records import Lease

TRACER_NAME = "runlane"
EXPORTERS = ("otlp", "console", "none")
# How an attempt may end without being an error (AttemptDriver.run's outcomes).
FINE_ENDINGS = frozenset({"no_changes", "pull_request", "released", "cancelled"})
_PROPAGATOR = TraceContextTextMapPropagator()
Attributes = Mapping[str, str | bool | int | float]

_override: trace.TracerProvider | None = None
_cached: tuple[trace.TracerProvider, trace.Tracer] | None = None


# --- the provider --------------------------------------------------------------------


def set_provider(provider: trace.TracerProvider | None) -> None:
    """Send runlane's spans to ``provider`` instead of the global one (None: back to
    the global). OpenTelemetry sets its global provider once per process; tests and
    applications that keep runlane's spans apart use this."""
    global _override
    _override = provider


def provider() -> trace.TracerProvider:
    return _override if _override is not None else trace.get_tracer_provider()


_NO_OP = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def enabled() -> bool:
    """Whether spans are recorded: a real provider is installed (the API's default is a
    proxy to a no-op one until someone sets one)."""
    return not isinstance(provider(), _NO_OP)


def tracer() -> trace.Tracer:
    global _cached
    current = provider()
    cached = _cached
    if cached is None or cached[0] is not current:
        from runlane.version import __version__

        cached = _cached = (current, current.get_tracer(TRACER_NAME, __version__))
    return cached[1]


def build_provider(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The SDK provider the standard variables ask for, or None for no tracing.

    ``OTEL_TRACES_EXPORTER``: a comma-separated list of ``otlp``, ``console`` (JSON on
    stderr: stdout is the commands' data) and ``none`` (spans recorded, exported
    nowhere: what a benchmark of the recording cost uses). Unset, runlane exports
    with ``otlp`` only when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and otherwise traces nothing: the
    specification's default, ``otlp`` to localhost, would have every command try a
    collector that is rarely there. ``OTEL_SDK_DISABLED=true`` turns it all off. The
    exporter reads its own variables (endpoint, headers, timeout, protocol), the batch
    processor ``OTEL_BSP_*``, the provider ``OTEL_TRACES_SAMPLER`` and the resource
    ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (service.name defaults to
    ``runlane``). Raises SettingsInvalid for an unknown exporter or a missing extra."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None:
        if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
            return None
        raw = "otlp"
    names = list(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise SettingsInvalid(f"OTEL_TRACES_EXPORTER {raw!r}: {unknown[0]!r} is not one of "
                              f"{', '.join(EXPORTERS)}")
    if not names:
        return None
    try:  # the SDK is the `otel` extra: only a process that exports spans needs it
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ModuleNotFoundError:
        raise SettingsInvalid(
            f"OTEL_TRACES_EXPORTER={raw} needs the OpenTelemetry SDK: "
            "pip install 'runlane[otel]'") from None

    exporters = [_exporter(name, env) for name in names if name != "none"]
    attributes: dict[str, str] = {}
    if not env.get("OTEL_SERVICE_NAME") and \
            "service.name=" not in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = "runlane"
    sdk = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        sdk.add_span_processor(BatchSpanProcessor(exporter))
    return sdk


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr)
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter()  # type: ignore[no-any-return]
        if protocol != "http/protobuf":
            raise SettingsInvalid(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: runlane sends "
                                  "http/protobuf or grpc")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        package = "grpc" if protocol == "grpc" else "http"
        raise SettingsInvalid(
            f"OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'runlane[otel]'"
            f" (opentelemetry-exporter-otlp-proto-{package})") from None
    return OTLPSpanExporter()


def configure_tracing(environ: Mapping[str, str] | None = None) -> bool:
    """Install the provider :func:`build_provider` makes as the global one (the CLI, at
    start-up); False when tracing stays off. Its spans are flushed at exit."""
    sdk = build_provider(environ)
    if sdk is None:
        return False
    trace.set_tracer_provider(sdk)
    return True


# --- context -------------------------------------------------------------------------


def traceparent(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` of ``span`` (None for an invalid one)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from(value: str | None) -> otel_context.Context | None:
    """The context a stored or received ``traceparent`` names (None: none given; a
    malformed one gives an empty context, so the span starts a trace of its own)."""
    if not value:
        return None
    return _PROPAGATOR.extract({"traceparent": value})


class Incoming:
    """``with Incoming(traceparent):`` makes the caller's context current (an HTTP
    request's ``traceparent`` header), so a submit joins the caller's trace."""

    __slots__ = ("_token", "_value")

    def __init__(self, value: str | None) -> None:
        self._value = value
        self._token: object | None = None

    def __enter__(self) -> None:
        ctx = context_from(self._value) if self._value and enabled() else None
        if ctx is not None:
            self._token = otel_context.attach(ctx)

    def __exit__(self, *_: object) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None


# --- submit --------------------------------------------------------------------------


class SubmitSpans:
    """One span per task of a submit (each task is its own trace, unless the caller's
    context is current: then they are its children). ``traceparents`` go to the store
    with the specs; :meth:`submitted` names each span's task and run."""

    def __init__(self, specs: Sequence[Any]) -> None:
        t = tracer()
        self._spans = [t.start_span("runlane.submit", kind=trace.SpanKind.PRODUCER,
                                    attributes=_present({"runlane.tenant": spec.tenant,
                                                         "runlane.queue": spec.queue}))
                       for spec in specs]
        self.traceparents: list[str | None] | None = [traceparent(s) for s in self._spans]

    def __enter__(self) -> SubmitSpans:
        return self

    def submitted(self, submissions: Sequence[Any]) -> None:
        for span, sub in zip(self._spans, submissions, strict=False):
            span.set_attributes(_present({
                "runlane.task_id": sub.task_id, "runlane.run_id": sub.run_id,
                "runlane.status": sub.status, "runlane.created": sub.created,
                "runlane.reason_code": sub.reason_code}))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for span in self._spans:
            if exc is not None:
                _failed(span, exc)
            span.end()


class _NoSubmitSpans:
    traceparents: list[str | None] | None = None

    def __enter__(self) -> _NoSubmitSpans:
        return self

    def submitted(self, submissions: Sequence[Any]) -> None:
        pass

    def __exit__(self, *_: object) -> None:
        pass


_NO_SUBMIT = _NoSubmitSpans()


def submit_spans(specs: Sequence[Any]) -> SubmitSpans | _NoSubmitSpans:
    return SubmitSpans(specs) if enabled() else _NO_SUBMIT


# --- stages --------------------------------------------------------------------------


class _Stage:
    """A child span of the current one, current itself while the block runs; an
    exception out of the block is recorded on it (status ERROR) and goes on."""

    __slots__ = ("_attributes", "_name", "_owner", "_previous", "_span", "_token")

    def __init__(self, name: str, attributes: Attributes | None,
                 owner: AttemptTrace | None = None) -> None:
        self._name = name
        self._attributes = attributes
        self._owner = owner  # the attempt whose agent events go here meanwhile
        self._previous: trace.Span | None = None
        self._span: trace.Span = trace.INVALID_SPAN
        self._token: object | None = None

    def __enter__(self) -> trace.Span:
        span = self._span = tracer().start_span(self._name, attributes=self._attributes)
        self._token = otel_context.attach(trace.set_span_in_context(span))
        if self._owner is not None:
            self._previous, self._owner.events_to = self._owner.events_to, span
        return span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._owner is not None and self._previous is not None:
            self._owner.events_to = self._previous
        if exc is not None:
            _failed(self._span, exc)
        self._span.end()
        otel_context.detach(self._token)  # type: ignore[arg-type]


class _NullStage:
    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *_: object) -> None:
        pass


_NULL_STAGE = _NullStage()


def stage(name: str, attributes: Attributes | None = None) -> _Stage | _NullStage:
    """``with stage("runlane.push"):`` a child of the current span (an attempt's), or
    nothing at all when no span is being recorded."""
    if not trace.get_current_span().is_recording():
        return _NULL_STAGE
    return _Stage(name, attributes)


class OpenStage:
    """A child span of the current one, ended by hand (:func:`start_stage`): for a
    stage whose code has several ways out."""

    __slots__ = ("span",)

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    @property
    def recording(self) -> bool:
        return self.span.is_recording()

    def end(self, attributes: Mapping[str, Any] | None = None) -> None:
        if attributes:
            self.span.set_attributes(_present(attributes))
        self.span.end()

    def fail(self, error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            _failed(self.span, error)
        else:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self.span.end()


_NULL_OPEN = OpenStage(trace.INVALID_SPAN)


def start_stage(name: str, attributes: Attributes | None = None) -> OpenStage:
    if not trace.get_current_span().is_recording():
        return _NULL_OPEN
    return OpenStage(tracer().start_span(name, attributes=attributes))


# --- attempts ------------------------------------------------------------------------


class AttemptTrace:
    """The span of one attempt, current on the attempt's thread from :func:`attempt`
    to :meth:`end`. The agent's control lines (read on another thread) become events
    of the stage running the agent (``events_to``)."""

    def __init__(self, span: trace.Span, token: object) -> None:
        self.span = span
        self.events_to = span
        self._token = token
        self._traceparent = traceparent(span)

    def stage(self, name: str, attributes: Attributes | None = None, *,
              events: bool = False) -> _Stage:
        """A stage of the attempt; ``events``: the agent's events go to it meanwhile."""
        return _Stage(name, attributes, self if events else None)

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self.events_to.add_event(name, _present(attributes))

    def set(self, attributes: Mapping[str, Any]) -> None:
        self.span.set_attributes(_present(attributes))

    def traceparent(self) -> str | None:
        return self._traceparent

    def end(self, ended: str) -> None:
        self.span.set_attribute("runlane.ended", ended)
        if ended not in FINE_ENDINGS:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, ended))
        self.span.end()
        otel_context.detach(self._token)  # type: ignore[arg-type]


class NoTrace:
    """An attempt without tracing: nothing recorded; the stored ``traceparent`` (of
    the submit) still reaches the agent."""

    __slots__ = ("_traceparent",)

    def __init__(self, stored: str | None = None) -> None:
        self._traceparent = stored

    def stage(self, name: str, attributes: Attributes | None = None, *,
              events: bool = False) -> _NullStage:
        return _NULL_STAGE

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        pass

    def set(self, attributes: Mapping[str, Any]) -> None:
        pass

    def traceparent(self) -> str | None:
        return self._traceparent

    def end(self, ended: str) -> None:
        pass


NO_TRACE = NoTrace()


def attempt(lease: Lease, stored: str | None,
            claimed_ns: tuple[int, int] | None = None) -> AttemptTrace | NoTrace:
    """Start the span of the attempt ``lease`` holds, a child of the submit's span
    (``stored``, the task's ``traceparent``), from the claim's start; its first stage,
    the claim's admission, is recorded from ``claimed_ns`` (wall clock, ns)."""
    if not enabled():
        return NoTrace(stored) if stored else NO_TRACE
    t = tracer()
    start = claimed_ns[0] if claimed_ns is not None else None
    span = t.start_span(
        "runlane.attempt", context=context_from(stored) or otel_context.Context(),
        kind=trace.SpanKind.CONSUMER, start_time=start, attributes={
            "runlane.task_id": lease.task_id, "runlane.run_id": lease.run_id,
            "runlane.attempt_id": lease.attempt_id, "runlane.attempt_no": lease.attempt_no,
            "runlane.lease_id": lease.attempt_id,
            "runlane.fencing_token": lease.fencing_token,
            "runlane.worker_id": lease.worker_id, "runlane.tenant": lease.tenant,
            "runlane.queue": lease.queue})
    inside = trace.set_span_in_context(span)
    if claimed_ns is not None:
        t.start_span("runlane.admission", context=inside, start_time=claimed_ns[0],
                     attributes={"runlane.queue": lease.queue,
                                 "runlane.priority": lease.priority}
                     ).end(end_time=claimed_ns[1])
    return AttemptTrace(span, otel_context.attach(inside))


# --- helpers -------------------------------------------------------------------------


def _present(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes without their None values (OpenTelemetry refuses them)."""
    return {k: v for k, v in attributes.items() if v is not None}


def _failed(span: trace.Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
