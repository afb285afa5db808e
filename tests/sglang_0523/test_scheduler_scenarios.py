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
globals().update(mod.scenario_tests(CONFIGS, ids=["cp2-pd", "cp3-pd-overlap"]))


def test_pd_sender_delaying_its_bootstrap(h):
    mod.check_pd_delayed(h, mod.run_pd(h))


def test_pd_senders_failing_in_bootstrap_and_after_transfer(h):
    mod.check_pd_failures(mod.run_pd(h))


def test_shutdown_through_the_input_socket_leaves_every_rank_idle_and_clean(h):
    chk.check_closed(h.close(), h.config)
