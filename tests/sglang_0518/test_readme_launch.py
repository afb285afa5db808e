"""The README's SGLang 0.5.18 launch line: every flag known to 0.5.18's own
parser, and the backend name the plugin registers."""

import pytest

from sglang_cp_hicache.sglang_0518 import plugin

from tests.helpers.readme_launch import launch_line, parse_with_sglang


def test_the_0518_launch_line_parses_and_names_the_registered_backend():
    args = parse_with_sglang(launch_line("SGLang 0.5.18 server"))
    assert args.radix_cache_backend == plugin.BACKEND_NAME == "cp-hicache"
    assert args.enable_hierarchical_cache and args.hicache_write_policy == "write_through"
    assert args.enable_prefill_cp and args.attn_cp_size > 1 and args.cp_strategy == "interleave"
    assert args.tp_size % args.attn_cp_size == 0 and args.page_size == 64


def test_the_parser_would_catch_a_misspelt_or_abbreviated_flag():
    with pytest.raises(SystemExit):
        parse_with_sglang(["--model-path", "m", "--radix-cache-backnd", "cp-hicache"])
    with pytest.raises(SystemExit):
        parse_with_sglang(["--model-path", "m", "--radix-cache", "cp-hicache"])
