"""The L3 host copy writes exactly what SGLang 0.5.23's own
``set_from_flat_data_page`` writes, in every host layout."""

from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from tests.helpers.host_copy_checks import host_copy_tests

test_the_host_copy_writes_what_sglangs_copy_writes, test_a_pool_that_hands_out_a_copy_gets_sglangs_copy = (
    host_copy_tests(MLATokenToKVPoolHost, DSAIndexerPoolHost)
)
