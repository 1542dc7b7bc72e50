"""The stages of a request on the gateway's serving path, as hooks an observer implements.

The path calls its :class:`Observer` at each stage, in the order a request takes them: admitted (or refused),
assigned (or its wait ended otherwise), sent to an engine and answered (or the call failed), re-queued, sent early
and taken back, finished. The base class does nothing, so the path needs no test for "is anyone watching";
:class:`gateway.tracing.Tracing` turns the stages into spans. Hooks are called on the request's own task (its
context: the current span), never awaited, and must not raise.
"""

from __future__ import annotations

from typing import Any

from flying.messages import Assignment, QueuedRequest


class Observer:
    """Hooks at the serving path's stages; each does nothing here."""

    def admitted(self, rec: QueuedRequest, started_ns: int) -> None:
        """Admission (validation, tokenization, the record) began at ``started_ns`` and made ``rec``."""

    def admission_failed(self, exc: BaseException, started_ns: int) -> None:
        """Admission began at ``started_ns`` and raised ``exc`` (a 4xx or 5xx answer follows)."""

    def assigned(self, rec: QueuedRequest, a: Assignment) -> None:
        """``rec``'s wait in the queue ended with the router's assignment ``a`` (at once on the fast path)."""

    def wait_failed(self, rec: QueuedRequest, exc: BaseException) -> None:
        """``rec``'s wait ended without an assignment: its client left, its budget ran out, or no engine lives."""

    def requeued(self, rec: QueuedRequest, why: str) -> None:
        """``rec``'s engine failed it before answering (``why``): it waits in the queue again, or fails."""

    def relaying(self, body: dict, url: str, path: str, stream: bool, headers: dict[str, str]) -> Any:
        """A call to the engine at ``url`` is about to be sent; ``headers`` (the call's own, may be added to: a
        trace context) go with it. Returns what :meth:`relayed` or :meth:`relay_failed` will be given."""
        return None

    def relayed(self, handle: Any, body: dict, stream: bool, status: int) -> None:
        """The engine answered the call ``handle`` names with ``status`` (a stream: its head; else the whole)."""

    def relay_failed(self, handle: Any, exc: BaseException) -> None:
        """The call ``handle`` names raised ``exc`` (unreachable, broken, or cancelled)."""

    def sent_early(self, rec: QueuedRequest) -> None:
        """``rec`` was sent to its engine before its admission completed (gateway.early_dispatch)."""

    def taken_back(self, rec: QueuedRequest) -> None:
        """``rec``'s early call will not be used (declined, refused, or its admission failed)."""

    def finished(self, rid: str, state: str, error: str) -> None:
        """Request ``rid`` ended in ``state`` (done, failed or cancelled; ``error`` says why it failed)."""


NOTHING = Observer()  # the path's observer when no one watches
