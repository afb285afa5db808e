"""The multi-rank CP HiCache simulator (``sglang-cp-hicache simulate``).

End-to-end runs start the CLI as a subprocess: N rank processes on a real
gloo group, each with a real SGLang 0.5.18 stack. Pure-Python parts (trace
parsing, the workload, the content functions) are tested in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.sim.config import FAIL_ENV, FailureInjection, parse_failure_injection
from sglang_cp_hicache.testing.content import (
    content_mismatches,
    corrupted_token_mask,
    pattern_bytes,
    prefix_keys,
    write_content,
)
from sglang_cp_hicache.sim.workload import TraceError, load_trace, synthetic_chat
from tests.sim.simrun import BOUND_S, simulate

P = 64


# ---------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------


@pytest.mark.slow(25)
def test_short_run_is_bit_exact_and_ranks_agree(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    proc, _ = simulate("--cp-size", "2", "--requests", "40", "--json", str(out),
                             "--plot", str(png), "--compare-non-cp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    for key in ("cp_size", "page_size", "requests", "verified_pages", "corrupted_pages", "backup_tokens",
                "load_back_tokens", "host_evicted_slots", "host_slots_per_rank", "acks_per_rank",
                "cpu_seconds", "non_cp"):
        assert key in s, key
    assert (s["cp_size"], s["page_size"], s["requests"]) == (2, P, 40)
    assert s["corrupted_pages"] == 0 and s["verified_pages"] > 0
    assert s["restored_pages_verified"] > 0  # restored bytes were checked, not just device hits
    # every mechanism ran: device eviction, write-through, host eviction, load-back
    assert s["device_evicted_tokens"] > 0
    assert s["backup_tokens"] > 0 and all(n > 0 for n in s["backup_slots_per_rank"])
    assert s["host_evicted_slots"] > 0
    assert s["load_back_tokens"] > 0 and s["load_backs"] > 0
    # ranks consumed identical acks, and one per queued operation
    acks = s["acks_per_rank"]
    assert len(acks) == 2 and acks[0] == acks[1]
    assert acks[0]["write_acks"] == acks[0]["writes_queued"] > 0
    assert acks[0]["load_acks"] == acks[0]["loads_queued"] > 0
    assert s["ranks_agree"] and len(set(s["tree_digests"])) == 1
    assert s["invariant_violations"] == [] and s["ok"]
    # per-rank host usage is bounded by the per-rank pool; physical slots per rank
    assert all(0 < peak <= cap for peak, cap in zip(s["host_slots_per_rank"], s["host_slot_capacity_per_rank"]))
    assert s["host_slot_capacity_per_rank"] == [s["host_pages"] * P] * 2
    assert s["cpu_seconds"] > 0
    nc = s["non_cp"]
    assert nc["corrupted_pages"] == 0 and nc["verified_pages"] > 0
    assert nc["host_slot_capacity"] == 2 * s["host_pages"] * P
    assert nc["host_slots"] > 0 and nc["cpu_seconds"] > 0
    assert len(s["series"]["host_slots_per_rank"][0]) == 40
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ranks agree (tree digest + acks, all_gather): yes" in proc.stdout
    assert "result: OK" in proc.stdout
    # 0.5.23's bookkeeping counters are not measured on 0.5.18: absent, not reported as zero
    assert not {"device_evictions", "device_index_host_reads", "host_room", "write_failures_per_rank"} & s.keys()
    assert "node backups refused" not in proc.stdout and "host reads of device locs" not in proc.stdout


@pytest.mark.slow(40)
def test_roomy_host_shares_stay_within_a_page_of_one_nth(tmp_path):
    """CP 4 with a host pool nothing is evicted from and a tight device pool:
    every rank's host slots end within one page of 1/4 of what non-CP holds,
    because the allocator evicts for a lane that runs dry (the same leaves on
    every rank). With SGLANG_CP_HICACHE_HOST_BALANCE=greedy the same run ends
    +2.5 / -2.5 pages off."""
    out = tmp_path / "roomy.json"
    proc, _ = simulate("--cp-size", "4", "--device-pages", "16", "--host-pages", "400",
                       "--requests", "120", "--compare-non-cp", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["ok"] and s["ranks_agree"] and s["corrupted_pages"] == 0
    assert s["host_evicted_slots"] == 0  # roomy: the shares are what was written
    comp = s["comparison"]
    assert all(abs(d) <= 1 for d in comp["host_slots_deviation_pages_per_rank"]), comp
    assert comp["host_slots_goal_met"]
    assert sum(s["host_slots_per_rank"]) == s["non_cp"]["host_slots"]
    assert s["host_balance"] == "exact"
    reclaims = s["lane_reclaims_per_rank"]
    assert reclaims[0] > 0 and len(set(reclaims)) == 1  # it acted, identically on every rank
    assert s["device_reclaimed_tokens"] > 0 and "for host balance" in proc.stdout
    assert s["all_reduces_per_request"]["cp"] == s["all_reduces_per_request"]["non_cp"]


@pytest.mark.slow(8)
def test_injected_rank_failure_stops_every_rank_with_a_clear_message():
    proc, seconds = simulate("--cp-size", "2", "--requests", "10", env={FAIL_ENV: "1:2"})
    assert proc.returncode == 1
    assert seconds < BOUND_S
    assert "rank 1 failed at request 2" in proc.stderr
    assert "injected failure" in proc.stderr
    assert "Traceback" not in proc.stderr  # the traceback is in the rank's log file
    assert "result: OK" not in proc.stdout


@pytest.mark.slow(15)
@pytest.mark.waits  # mostly waits out a timeout or a death, little CPU
def test_a_rank_that_stops_answering_is_bounded_by_the_collective_timeout():
    proc, seconds = simulate("--cp-size", "2", "--requests", "10", "--collective-timeout", "3",
                             env={FAIL_ENV: "1:2:hang"})
    assert proc.returncode == 1
    assert seconds < BOUND_S
    headline = proc.stderr.splitlines()[0]
    # the silent rank is the cause, not the peer that timed out waiting for it
    assert headline.startswith("CP2: rank 1 stopped answering collectives"), proc.stderr
    assert "the launcher terminated it" in headline
    assert "then rank 0 failed at request 2" in proc.stderr  # timed out waiting for rank 1
    assert "Timed out" in proc.stderr or "timed out" in proc.stderr


@pytest.mark.slow(12)
@pytest.mark.waits  # mostly waits out a timeout or a death, little CPU
def test_a_corrupted_restore_fails_the_run(tmp_path):
    out = tmp_path / "sim.json"
    proc, _ = simulate("--cp-size", "2", "--requests", "40", "--json", str(out), env={FAIL_ENV: "0:0:corrupt"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["corrupted_pages"] > 0 and not s["ok"]
    assert "corrupted" in proc.stdout


@pytest.mark.slow(10)
def test_trace_replay(tmp_path):
    trace = tmp_path / "trace.jsonl"
    sys_prompt = list(range(100, 100 + 3 * P))
    lines = [
        {"tokens": sys_prompt + [7] * 40},
        {"prompt_len": 300, "prefix_group": "a", "shared_len": 256},
        {"tokens": sys_prompt + [8] * 90},
        "",
        {"prompt_len": 400, "prefix_group": "a", "note": "extra keys are ignored"},
        {"prompt_len": 200, "prefix_group": 3},
        {"tokens": sys_prompt + [7] * 40 + [9] * 70},
    ]
    trace.write_text("\n".join(json.dumps(x) if x != "" else "" for x in lines) + "\n")
    out = tmp_path / "sim.json"
    # the default pools, not ones sized from this tiny trace: the hits below assume nothing is evicted
    proc, _ = simulate("--cp-size", "2", "--device-pages", "12", "--host-pages", "16", "--trace", str(trace),
                       "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["requests"] == 6 and s["workload"] == f"trace:{trace}"
    assert s["corrupted_pages"] == 0 and s["verified_pages"] > 0
    # line 3 and the last line hit the 3-page system prompt; group "a" shares 200 tokens = 3 pages
    assert s["device_hit_tokens"] == 9 * P


def test_malformed_trace_line_names_the_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"tokens": [1, 2, 3]}\n\n{"prompt_len": -5, "prefix_group": "x"}\n')
    proc, seconds = simulate("--trace", str(trace))
    assert proc.returncode == 2
    assert f"{trace}:3: 'prompt_len' must be a positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert seconds < 30  # rejected before any rank starts


def test_bad_flags_are_argparse_errors(capsys):
    from sglang_cp_hicache.__main__ import main

    for args, needle in (
        (["--page-size", "32"], "requires page size 64"),
        (["--cp-size", "0"], "--cp-size must be an integer in [1, 64]"),
        (["--requests", "many"], "--requests must be an integer"),
        (["--host-pages", "-1"], "--host-pages must be an integer >= 1"),
        (["--collective-timeout", "0"], "must be > 0"),
        (["--frobnicate"], "unrecognized arguments"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", *args])
        assert exc.value.code == 2, args
        err = capsys.readouterr().err
        assert needle in err, (args, err)


def test_console_script_is_installed_and_parses():
    script = os.path.join(os.path.dirname(sys.executable), "sglang-cp-hicache")
    if not os.path.exists(script):
        pytest.skip("console script not installed in this environment")
    proc = subprocess.run([script, "simulate", "--page-size", "128"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "requires page size 64" in proc.stderr


def test_progress_bar_without_a_terminal():
    import io

    from sglang_cp_hicache.sim.progress import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar("CP2", 20, stream=stream)
    for done in range(1, 21):
        bar.update(done)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("CP2 replay [") and "20/20 requests" in lines[-1]
    assert "left" in lines[5] and "left" not in lines[-1]  # an estimate while it runs


def test_main_parses_and_rejects(tmp_path):
    from sglang_cp_hicache.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--page-size", "16"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_malformed_failure_hook_is_rejected():
    proc, _ = simulate(env={FAIL_ENV: "one:two"})
    assert proc.returncode == 2 and FAIL_ENV in proc.stderr
    assert parse_failure_injection("2:5:hang") == FailureInjection(2, 5, "hang")
    assert parse_failure_injection("") is None


# ---------------------------------------------------------------------------
# Trace parsing and the synthetic workload (in-process)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"tokens": []}', "non-empty list"),
        ('{"tokens": [1, true]}', "'tokens'[1] must be an integer"),
        ('{"tokens": [1, -3]}', "'tokens'[1] must be an integer"),
        ('{"prompt_len": 10}', "needs a 'prefix_group'"),
        ('{"prompt_len": 1.5, "prefix_group": "g"}', "'prompt_len' must be a positive integer"),
        ('{"prompt_len": 10, "prefix_group": [1]}', "'prefix_group' must be a string or an integer"),
        ('{"prompt_len": 10, "prefix_group": "g", "shared_len": 11}', "'shared_len' must be an integer"),
        ('{"foo": 1}', "expected a 'tokens' list or a 'prompt_len'"),
    ],
)
def test_trace_errors_name_the_line(tmp_path, line, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tokens": [5]}\n' + line + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(trace, seed=0)
    assert exc.value.line_no == 2
    assert message in str(exc.value) and str(exc.value).startswith(f"{trace}:2: ")


def test_trace_request_longer_than_the_device_is_rejected(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 5000, "prefix_group": "g"}\n')
    with pytest.raises(TraceError, match=r":1: request has 5000 tokens"):
        load_trace(trace, seed=0, max_tokens=4096)


def test_trace_groups_share_exactly_their_shared_prefix(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"prompt_len": 300, "prefix_group": "a", "shared_len": 200}\n'
        '{"prompt_len": 300, "prefix_group": "a", "shared_len": 250}\n'
        '{"prompt_len": 300, "prefix_group": "b", "shared_len": 250}\n'
    )
    a1, a2, b = load_trace(trace, seed=1)
    assert len(a1) == len(a2) == len(b) == 300
    assert a1.tokens[:200] == a2.tokens[:200] and a1.tokens[200:] != a2.tokens[200:250]
    assert a1.tokens[:50] != b.tokens[:50]
    assert load_trace(trace, seed=1) == [a1, a2, b]  # deterministic
    assert load_trace(trace, seed=1, limit=2) == [a1, a2]


def test_synthetic_chat_is_deterministic_shares_prefixes_and_respects_the_cap():
    reqs = synthetic_chat(200, seed=3, max_tokens=1500)
    assert reqs == synthetic_chat(200, seed=3, max_tokens=1500)
    assert reqs != synthetic_chat(200, seed=4, max_tokens=1500)
    assert len(reqs) == 200 and all(0 < len(r) <= 1500 for r in reqs)
    kinds = {r.label.split(":")[0] for r in reqs}
    assert kinds == {"new", "extend", "fork"}
    # an extension carries its whole conversation as a prefix of an earlier request
    tokens = [r.tokens for r in reqs]
    extends = [i for i, r in enumerate(reqs) if r.label == "extend"]
    assert all(any(tokens[i][: len(tokens[j])] == tokens[j] for j in range(i)) for i in extends)


# ---------------------------------------------------------------------------
# Content (pure torch, with a stand-in for DSATokenToKVPool's buffers)
# ---------------------------------------------------------------------------


def fake_dsa_pool(pages: int = 4, layers: int = 2) -> SimpleNamespace:
    index_head_dim, quant_block = 128, 128
    row = P * (index_head_dim + index_head_dim // quant_block * 4)
    return SimpleNamespace(
        page_size=P, layer_num=layers, index_head_dim=index_head_dim, quant_block_size=quant_block,
        kv_buffer=[torch.zeros(pages * P, 1, 576, dtype=torch.bfloat16) for _ in range(layers)],
        index_k_with_scale_buffer=[torch.zeros(pages, row, dtype=torch.uint8) for _ in range(layers)],
    )


def test_prefix_keys_depend_on_position_and_the_whole_prefix():
    a = prefix_keys([5, 6, 7, 8])
    b = prefix_keys([5, 6, 9, 8])
    assert a.dtype == torch.int64 and a.shape == (4,)
    assert torch.equal(a[:2], b[:2]) and not bool((a[2:] == b[2:]).any())
    assert int(a.min()) >= 0 and int(a.max()) < 2**31
    assert len(set(prefix_keys([1] * 100).tolist())) == 100


def test_prefix_keys_continue_from_the_key_before():
    whole = prefix_keys(list(range(3, 203)))
    for cut in (1, 64, 199):
        tail = prefix_keys(list(range(3 + cut, 203)), start=int(whole[cut - 1]))
        assert torch.equal(tail, whole[cut:])
    assert not torch.equal(prefix_keys([7, 8], start=5), prefix_keys([7, 8]))


def test_content_round_trip_and_every_corrupted_byte_is_caught():
    pool = fake_dsa_pool()
    locs = torch.arange(P, 3 * P)
    keys = prefix_keys(list(range(2 * P)))
    write_content(pool, locs, keys, seed=5)
    assert content_mismatches(pool, locs, keys, seed=5) == []
    assert not bool(corrupted_token_mask(pool, locs, keys, seed=5).any())
    # wrong key (another prefix) or wrong seed: every token differs
    assert bool(corrupted_token_mask(pool, locs, keys + 1, seed=5).all())
    assert content_mismatches(pool, locs, keys, seed=6) != []
    # one flipped bit in each part is caught, on exactly that token
    for flip in ("kv", "index_k", "index_scale"):
        pool = fake_dsa_pool()
        write_content(pool, locs, keys, seed=5)
        token = 70  # page 1 of locs, offset 6
        if flip == "kv":
            pool.kv_buffer[1].view(torch.uint8)[locs[token], 0, 1000] ^= 0x80
        elif flip == "index_k":
            pool.index_k_with_scale_buffer[0][locs[token] // P, (locs[token] % P) * 128 + 3] ^= 1
        else:
            pool.index_k_with_scale_buffer[1][locs[token] // P, P * 128 + (locs[token] % P) * 4] ^= 1
        bad = corrupted_token_mask(pool, locs, keys, seed=5)
        assert torch.nonzero(bad).reshape(-1).tolist() == [token], flip
        assert len(content_mismatches(pool, locs, keys, seed=5)) == 1


def test_pattern_bytes_has_no_overflow_at_the_key_bound():
    keys = torch.tensor([0, 1, 2**31 - 1], dtype=torch.int64)
    out = pattern_bytes(keys, 576 * 2, seed=2**31 - 1, layer=63, part=3)
    assert out.dtype == torch.uint8 and out.shape == (3, 1152)
    assert len({bytes(r.tolist()) for r in out}) == 3


def _pattern_byte_exact(key: int, col: int, seed: int, layer: int, part: int) -> int:
    """The hash on Python's exact integers, one byte at a time."""
    salt = (seed * 104_729 + layer * 4_099 + part * 613) % 2**31
    x = ((key % 2**31) * 1_000_003 + col * 7_919 + salt) % 2**31
    x ^= x >> 7
    x = (x * 2_654_435_761) % 2**32
    x ^= x >> 15
    return x & 0xFF


@pytest.mark.parametrize("width", [1, 9, 576, 656])
def test_pattern_bytes_is_the_exact_integer_hash_on_both_forms(width):
    from sglang_cp_hicache.testing.content import _pattern_bytes_int64

    g = torch.Generator().manual_seed(width)
    keys = torch.cat([torch.tensor([0, 1, 2**31 - 2, 2**31 - 1]), torch.randint(0, 2**31 - 1, (60,), generator=g)])
    for seed, layer, part in [(0, 0, 1), (7, 60, 3), (2**31 - 1, 63, 2)]:
        fast = pattern_bytes(keys, width, seed=seed, layer=layer, part=part)  # CPU: 32-bit wrap-around
        wide = _pattern_bytes_int64(keys, width, seed=seed, layer=layer, part=part)
        assert fast.dtype == torch.uint8 and fast.shape == (keys.numel(), width)
        assert torch.equal(fast, wide)
        cols = sorted({0, width // 2, width - 1})
        for row in (0, 3, 17, keys.numel() - 1):
            for col in cols:
                want = _pattern_byte_exact(int(keys[row]), col, seed, layer, part)
                assert int(fast[row, col]) == want, (row, col)
    strided = torch.arange(0, 600, 2, dtype=torch.int32)[::3]  # another dtype, not contiguous
    assert torch.equal(pattern_bytes(strided, width, seed=1, layer=0, part=2),
                       _pattern_bytes_int64(strided, width, seed=1, layer=0, part=2))


def test_json_dump_round_trips():
    from sglang_cp_hicache.sim.report import dump_json

    summary = {"a": 1, "b": [1, 2], "c": {"d": [[1, 2], [3]], "e": None, "f": {"g": 0.5}}, "h": "x"}
    text = dump_json(summary)
    assert json.loads(text) == summary
    assert '\n  "d": [[1, 2], [3]],\n' in text  # nested values stay on one line
