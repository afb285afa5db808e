"""PD prefill on the harness: SGLang's FAKE transfer classes, the sender scripted.

A prefill server refuses the ``fake`` backend, so the harness asks for
``nixl`` and maps the prefill module's class lookups to SGLang's own fake
classes. The sender follows the run's :class:`~.sched_config.PdScript` for
its bootstrap room: stay in bootstrap for k polls (the scheduler prefills
optimistically meanwhile), then succeed, or fail in bootstrap or after the
KV was sent. Polls are counted per rank; every rank runs the same script, so
the all-reduced poll agrees.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.testing.sched_config import SchedConfig

__all__ = ["scripted_kv_class"]


def _scripted_sender(config: SchedConfig) -> type:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.fake import FakeKVSender

    class ScriptedFakeKVSender(FakeKVSender):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            room = kwargs.get("bootstrap_room", args[2] if len(args) > 2 else None)
            self.script = config.script_for(int(room)) if room is not None else None
            self.bootstrap_polls_left = self.script.bootstrap_polls if self.script else 0

        def poll(self) -> Any:
            if self.conclude_state is not None or self.script is None:
                return super().poll()
            if self.bootstrap_polls_left > 0:
                self.bootstrap_polls_left -= 1
                return KVPoll.Bootstrapping
            if self.script.fail == "bootstrap" or (self.script.fail == "transfer" and self.has_sent):
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            return super().poll()

    return ScriptedFakeKVSender


def scripted_kv_class(config: SchedConfig) -> Callable[[Any, Any], Any]:
    """Stands in for ``disaggregation.prefill.get_kv_class``: FAKE classes, the sender scripted."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    sender = _scripted_sender(config)

    def get_fake_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if class_type == KVClassType.SENDER:
            return sender
        return get_kv_class(TransferBackend.FAKE, class_type)

    return get_fake_kv_class
