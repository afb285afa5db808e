"""Repeatable intake for the real-scheduler harness: which requests SGLang's
loop sees at each ``recv_requests`` depends on the parent's order of
events only, never on when zmq delivers.

ZMQ hands a pushed message to the receiving socket asynchronously, so a
request the parent pushed just before letting a batch go may or may not be
in rank 0's next non-blocking drain; the batch after it then differs from
run to run. Here the parent tells rank 0, over its pipe and before the
push, how many messages it has pushed in all (:class:`Expect`; a pipe write
is readable once it returns, the push arrives later). Rank 0's drain of the
input socket (SGLang's ``sock_recv`` in its request receiver, the one seam)
then waits for every message up to that count before it reports the socket
empty. Every rank counts the messages its loop processed, so the parent
knows when the ranks are idle with all of them handled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["DELIVERY_TIMEOUT_MS", "Expect", "Intake", "install_intake"]

#: How long rank 0 waits for a message the parent says it pushed.
DELIVERY_TIMEOUT_MS = 60_000


@dataclass(frozen=True)
class Expect:
    """Parent to rank 0: messages pushed on the input socket so far."""

    sent: int


@dataclass
class Intake:
    expected: int = 0  # rank 0: messages the parent pushed, as last told
    received: int = 0  # rank 0: messages taken off the input socket
    processed: int = 0  # every rank: messages its loop handed to process_input_requests

    def take(self, message: Any) -> bool:
        """Note ``message`` if it is an :class:`Expect` (True), else leave it (False)."""
        if not isinstance(message, Expect):
            return False
        self.expected = max(self.expected, message.sent)
        return True


def install_intake(scheduler: Any, rank: int, channel: Any, intake: Intake) -> None:
    """Count what every rank processes; on rank 0, drain the input socket up to the parent's count."""
    process = scheduler.process_input_requests

    def counted(recv_reqs: Any, *args: Any, **kwargs: Any) -> Any:
        intake.processed += len(recv_reqs or ())
        return process(recv_reqs, *args, **kwargs)

    scheduler.process_input_requests = counted
    if rank != 0:
        return
    import zmq
    from sglang.srt.managers.scheduler_components import request_receiver

    socket = scheduler.ipc_channels.recv_from_tokenizer
    original: Callable[..., Any] = request_receiver.sock_recv

    def sock_recv(sock: Any, flags: int = 0) -> Any:
        if sock is not socket:
            return original(sock, flags)
        while channel.poll():  # the parent's counts (no gate answer can be pending here)
            message = channel.recv()
            if not intake.take(message):
                raise RuntimeError(f"rank 0: unexpected {message!r} from the parent outside a batch gate")
        if intake.received < intake.expected and not sock.poll(DELIVERY_TIMEOUT_MS, zmq.POLLIN):
            raise RuntimeError(f"rank 0: message {intake.received + 1} of {intake.expected} the parent pushed "
                               f"did not arrive in {DELIVERY_TIMEOUT_MS} ms")
        obj = original(sock, flags)  # zmq.Again when the parent pushed nothing more
        intake.received += 1
        return obj

    request_receiver.sock_recv = sock_recv
