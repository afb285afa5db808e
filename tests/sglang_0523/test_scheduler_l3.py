"""The library's L3 under SGLang 0.5.23's real Scheduler (CP 2, a PD prefill server): the
scenarios of tests/helpers/sched_l3.py."""

from tests.helpers import sched_l3

globals().update(sched_l3.l3_tests("0.5.23"))
