"""The library's L3 under SGLang 0.5.23's real Scheduler (CP 2, a PD
prefill server): SGLang's own prefetch brings an L3-only prefix back through the
library, and an abort lands while a prefetch is in flight
(tests/helpers/sched_l3.py says how). Every forward checks each prefix row
on its owner rank; SGLang's strict idle leak checks run after each scenario
and at shutdown."""

from __future__ import annotations

import pytest

from tests.helpers import sched_checks as chk
from tests.helpers import sched_l3

pytestmark = pytest.mark.slow(60)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    yield from sched_l3.start(sched_l3.config("0.5.23", str(tmp_path_factory.mktemp("l3"))))


def test_an_l3_only_prefix_is_prefetched_loaded_back_and_forwarded_from(run):
    sched_l3.check_restore(*run)


def test_an_abort_while_the_prefetch_is_in_flight_leaves_nothing_behind(run):
    sched_l3.check_abort_mid_prefetch(run[0])


def test_shutdown_after_l3_scenarios_leaves_every_rank_clean(run):
    h, _ = run
    chk.check_closed(h.close(), h.config)
