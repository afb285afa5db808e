"""The README's SGLang 0.5.23 prefill launch line: every flag known to
0.5.23's own parser, and every requirement of upstream's KV sharding with
DSA HiCache (``arg_groups/kv_shard_hook.py``) that does not need a GPU or a
model met by the values it sets."""

import pytest

from tests.helpers.readme_launch import launch_line, parse_with_sglang


def test_the_0523_launch_line_parses_and_meets_upstream_s_kv_sharding_requirements():
    args = parse_with_sglang(launch_line("SGLang 0.5.23 prefill worker"))
    assert args.disaggregation_mode == "prefill"
    assert args.disaggregation_transfer_backend == "mooncake"
    assert args.enable_kv_cache_sharding and args.enable_prefill_cp
    assert args.attn_cp_size > 1 and args.cp_strategy == "interleave" and args.pp_size == 1
    assert args.tp_size % args.attn_cp_size == 0
    assert (args.dsa_prefill_backend, args.dsa_decode_backend) == ("trtllm", "trtllm")
    assert args.kv_cache_dtype == "fp8_e4m3" and args.page_size == 64
    assert args.enable_hierarchical_cache and args.hicache_io_backend == "kernel"
    assert args.hicache_mem_layout in ("layer_first", "page_first")
    assert args.hicache_host_memory_mode == "cache"
    assert args.hicache_storage_backend is None and args.radix_cache_backend is None
    assert not args.enable_dsa_cache_layer_split
    assert args.hicache_write_policy == "write_through"


def test_the_parser_would_catch_a_misspelt_or_abbreviated_flag():
    with pytest.raises(SystemExit):
        parse_with_sglang(["--model-path", "m", "--enable-kv-cache-shardng"])
    with pytest.raises(SystemExit):
        parse_with_sglang(["--model-path", "m", "--enable-kv-cache-shard"])
