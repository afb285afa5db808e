"""Requests as SGLang's tokenizer manager sends them to the scheduler (both releases)."""

from __future__ import annotations

from array import array
from typing import Any, Optional, Sequence

__all__ = ["abort_req", "generate_req", "io_struct", "shutdown_req"]

#: A bootstrap host that is not SGLang's FAKE_BOOTSTRAP_HOST (requests with that
#: host are warm-up requests and skip the radix cache).
BOOTSTRAP_HOST = "127.0.0.1"


def io_struct() -> Any:
    """SGLang's ``io_struct`` module (importable here without torchvision)."""
    from sglang_cp_hicache.testing.torchvision_standin import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang.srt.managers import io_struct as module

    return module


def generate_req(rid: str, input_ids: Sequence[int], *, max_new_tokens: int = 2,
                 bootstrap_room: Optional[int] = None) -> Any:
    """A ``TokenizedGenerateReqInput`` (greedy, ``ignore_eos``); PD prefill
    requests carry ``bootstrap_room``."""
    TokenizedGenerateReqInput = io_struct().TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    if not input_ids:
        raise ValueError(f"input_ids must not be empty (request {rid!r})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    params.normalize(None)
    params.verify(1024)
    extra: dict[str, Any] = {}
    if bootstrap_room is not None:
        extra = dict(bootstrap_host=BOOTSTRAP_HOST, bootstrap_room=int(bootstrap_room))
    return TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=array("q", [int(t) for t in input_ids]), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False, **extra)


def abort_req(rid: str) -> Any:
    return io_struct().AbortReq(rid=rid)


def shutdown_req() -> Any:
    """Every rank receives it on the same loop iteration (broadcast from rank 0) and leaves the loop."""
    return io_struct().ShutdownReq()
