"""SGLang 0.5.18's real Scheduler as a PD prefill server (CP 2, the
cp-hicache backend) on both PD prefill loops, normal and overlap, its fake
PD sender scripted.

SGLang 0.5.18 turns optimistic prefill off under HiCache unless the write
policy is write_back, which CP shared KV refuses: the delayed sender's
request waits in the bootstrap queue instead (the test checks SGLang
resolved it so and that the request was not forwarded early).
"""

from __future__ import annotations

import pytest

from tests.helpers import sched_checks as chk
from tests.helpers import sched_module as mod

pytestmark = pytest.mark.slow(60)

_CLOSED: list = []


@pytest.fixture(scope="module", params=[False, True], ids=["pd-normal", "pd-overlap"])
def h(request):
    yield from chk.run_harness(chk.pd_config("0.5.18", 2, overlap=request.param), _CLOSED)


def test_chunked_prefill_second_request_rides_the_first_ones_chunks(h):
    mod.run_chunked(h)


def test_pd_sender_delaying_its_bootstrap(h):
    assert all(r.optimistic_prefill_attempts == 0 for r in h.ready), h.ready
    mod.check_pd_delayed(h, mod.run_pd(h))


def test_pd_senders_failing_in_bootstrap_and_after_transfer(h):
    mod.check_pd_failures(mod.run_pd(h))


def test_abort_mid_chunk(h):
    mod.run_abort_mid_chunk(h)


def test_shutdown_through_the_input_socket_leaves_every_rank_idle_and_clean(h):
    chk.check_closed(h.close(), h.config)
