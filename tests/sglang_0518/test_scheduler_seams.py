"""Every seam of the real-scheduler harness resolves in SGLang 0.5.18; a moved one fails loudly."""

from tests.helpers.sched_seam_checks import seam_tests

globals().update(seam_tests("0.5.18"))
