"""The library's L3 under SGLang 0.5.18's real Scheduler (CP 2, normal
loop): SGLang's own prefetch brings an L3-only prefix back through the
library, and an abort lands while a prefetch is in flight
(tests/helpers/sched_l3.py says how). Every forward checks each prefix row
on its owner rank; SGLang's strict idle leak checks run after each scenario
and at shutdown."""

from __future__ import annotations

import pytest

from tests.helpers import sched_l3

pytestmark = pytest.mark.slow(60)

globals().update(sched_l3.l3_tests("0.5.18"))
