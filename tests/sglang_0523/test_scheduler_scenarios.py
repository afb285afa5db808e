"""SGLang 0.5.23's real Scheduler drives the library's CP HiCache (PD prefill:
CP 2 on the normal loop, CP 3 on the overlap loop).

0.5.23's page-interleave sharded allocator refuses decode, so CP > 1 runs as
a PD prefill server; the PD transfer classes are SGLang's fake ones with a
scripted sender (delayed bootstrap, failures). Every forward checks each
prefix row attention would read on its owner rank, and SGLang's strict idle
leak checks run after every scenario.
"""

from __future__ import annotations

import pytest

from tests.helpers import sched_checks as chk
from tests.helpers import sched_module as mod

pytestmark = pytest.mark.slow(120)

CONFIGS = [chk.pd_config("0.5.23", 2, overlap=False), chk.pd_config("0.5.23", 3, overlap=True)]
_CLOSED: list = []


@pytest.fixture(scope="module", params=CONFIGS, ids=["cp2-pd", "cp3-pd-overlap"])
def h(request):
    yield from chk.run_harness(request.param, _CLOSED)


def test_chunked_prefill_second_request_rides_the_first_ones_chunks(h):
    mod.run_chunked(h)


def test_abort_mid_chunk(h):
    mod.run_abort_mid_chunk(h)


def test_host_hit_after_eviction_churn_is_loaded_back(h):
    o = mod.run_host_hit(h)
    chk.check_loaded_back(o, list(o.outputs))


def test_concurrent_load_backs_in_one_batch(h):
    mod.check_concurrent(mod.run_concurrent(h))


def test_abort_after_load_back(h):
    o = mod.run_abort_after_load_back(h)
    chk.check_aborted(o, sorted(o.outputs)[0])
    assert o.load_backs and o.declined_tokens() == 0, o.load_backs


def test_pd_sender_delaying_its_bootstrap(h):
    mod.check_pd_delayed(h, mod.run_pd(h))


def test_pd_senders_failing_in_bootstrap_and_after_transfer(h):
    mod.check_pd_failures(mod.run_pd(h))


def test_shutdown_through_the_input_socket_leaves_every_rank_idle_and_clean(h):
    chk.check_closed(h.close(), h.config)
