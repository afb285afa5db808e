"""The L3 host copy writes exactly what SGLang 0.5.23's own
``set_from_flat_data_page`` writes, in every host layout."""

import pytest
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from tests.helpers.host_copy_checks import LAYOUTS, check_a_copied_page_falls_back, check_same_bytes_as_sglang


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_host_copy_writes_what_sglangs_copy_writes(layout):
    check_same_bytes_as_sglang(MLATokenToKVPoolHost, DSAIndexerPoolHost, layout)


def test_a_pool_that_hands_out_a_copy_gets_sglangs_copy():
    check_a_copied_page_falls_back(MLATokenToKVPoolHost, DSAIndexerPoolHost)
