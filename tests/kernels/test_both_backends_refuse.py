"""The CPU backends refuse the same calls: whatever the Triton launchers
refuse (non-contiguous index tensors or device layers, host rows that are not
dense) the torch reference refuses too, with the same message naming the
argument and nothing written -- through the four copies and through bound
copies (buffers at bind time, indices per call). And no copy writes one
destination page twice: a backup naming a host page twice (or a load naming
a device page twice) is refused whenever the indices are read (CPU indices
always, CUDA indices in debug mode), on both backends."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.kernel_pools import bits, make_pools, page_locs, run_oracle
from sglang_cp_hicache.kernels import DEBUG_ENV, _checks, _triton_launch, transfer
from sglang_cp_hicache.kernels.bound import bind_indexer_copies, bind_kv_copies
from sglang_cp_hicache.placement import CpPlacement

# Every test picks its backend itself (TRITON_INTERPRET set or removed per test) or
# calls the launcher, which interprets CPU tensors whatever the variable says:
# the interpreted re-run would repeat it unchanged.
pytestmark = pytest.mark.same_under_interpret

P = 4
RANK0 = CpPlacement(P, 2, 0)  # owns the even logical pages
I64 = torch.int64
BACKENDS = [pytest.param(None, id="reference"), pytest.param("1", id="interpret")]
KINDS = ("kv_bf16", "indexer")


def _backend(monkeypatch, interpret: str | None) -> str:
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    return transfer.select_backend("cpu")


def _pools(kind: str, direction: str):
    # 3 layers, 5 device pages per layer, 6 host pages, inside guard bands
    return make_pools(kind, P, "page_first", RANK0, direction=direction)


def _call(pools, direction: str, dl, hl, *, devs=None, host=None, layer_id: int = 1) -> None:
    """One unbound copy through kernels.transfer (the backend picked per call)."""
    devs = pools.devs if devs is None else devs
    host = pools.host if host is None else host
    h, placement = pools.host_layout, pools.placement
    if pools.kv and direction == "d2h":
        transfer.backup_kv_all_layers(devs, host, h, dl, hl, placement)
    elif pools.kv:
        transfer.load_kv_one_layer(devs[layer_id], host, h, layer_id, dl, hl, placement)
    elif direction == "d2h":
        transfer.backup_indexer_all_layers(devs, host, h, dl, hl, placement)
    else:
        transfer.load_indexer_one_layer(devs[layer_id], host, h, layer_id, dl, hl, placement)


def _bind(pools, *, devs=None, host=None):
    fn = bind_kv_copies if pools.kv else bind_indexer_copies
    return fn(pools.devs if devs is None else devs, pools.host if host is None else host,
              pools.host_layout, pools.placement)


def _snapshot(pools) -> list[torch.Tensor]:
    return [bits(b).clone() for b in (*pools.dev_bigs, pools.host_big)]


def _unchanged(pools, before) -> bool:
    return all(torch.equal(a, bits(b)) for a, b in zip(before, (*pools.dev_bigs, pools.host_big)))


GOOD_DL = page_locs([0, 1, 2, 4], P)  # rank 0 owns logical pages 0, 2, 4 -> physical 0, 1, 2
GOOD_HL = page_locs([5, 0, 3], P)


def _strided(locs: torch.Tensor) -> torch.Tensor:
    """The same values as ``locs``, in a non-contiguous view."""
    wide = torch.zeros(2 * locs.numel(), dtype=I64)
    wide[::2] = locs
    return wide[::2]


def _non_contiguous_layer(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous tensor of the same shape (every other row of a wider one)."""
    wide = torch.zeros((t.shape[0] * 2, *t.shape[1:]), dtype=t.dtype)
    wide[::2] = t
    return wide[::2]


def _sparse_rows(host: torch.Tensor) -> torch.Tensor:
    """``host``'s values with stride(-1) == 2 (rows not dense)."""
    wide = torch.zeros((*host.shape[:-1], 2 * host.shape[-1]), dtype=host.dtype)
    wide[..., ::2] = host
    return wide[..., ::2]


# (case id, direction, what to change, message start)
REFUSED = [
    ("device_locs-strided", "d2h", "dl", "device_locs must be contiguous"),
    ("host_locs-strided", "d2h", "hl", "host_locs must be contiguous"),
    ("device_locs-strided-load", "h2d", "dl", "device_locs must be contiguous"),
    ("host_locs-strided-load", "h2d", "hl", "host_locs must be contiguous"),
    ("device-layer-strided", "d2h", "dev", "{dev} must be contiguous"),
    ("device-layer-strided-load", "h2d", "dev", "{dev} must be contiguous"),
    ("host-rows-sparse", "d2h", "host", "{host} rows must be dense"),
    ("host-rows-sparse-load", "h2d", "host", "{host} rows must be dense"),
]


def _bad_args(pools, direction: str, change: str):
    dl, hl, devs, host = GOOD_DL, GOOD_HL, list(pools.devs), pools.host
    if change == "dl":
        dl = _strided(dl)
    elif change == "hl":
        hl = _strided(hl)
    elif change == "dev":
        devs[1] = _non_contiguous_layer(devs[1])  # loads use layer 1
    else:
        host = _sparse_rows(host)
    return dl, hl, devs, host


def _names(kind: str, direction: str) -> dict[str, str]:
    stem = "kv" if kind.startswith("kv") else "index"
    dev = f"device_{stem}[1]" if direction == "d2h" else f"device_{stem}_layer"
    return {"dev": dev, "host": f"host_{stem}"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case,direction,change,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_both_backends_refuse_what_the_kernel_cannot_take(monkeypatch, kind, case, direction, change, message):
    """Same ValueError on the reference and under the interpreter, nothing written."""
    want = message.format(**_names(kind, direction))
    errors = {}
    for interpret in (None, "1"):
        backend = _backend(monkeypatch, interpret)
        pools = _pools(kind, direction)
        dl, hl, devs, host = _bad_args(pools, direction, change)
        before = _snapshot(pools)
        with pytest.raises(ValueError) as info:
            _call(pools, direction, dl, hl, devs=devs, host=host)
        assert _unchanged(pools, before), f"{backend}: a refused call wrote something"
        errors[backend] = str(info.value)
    assert set(errors) == {"reference", "triton-interpret"}
    assert errors["reference"] == errors["triton-interpret"], errors
    assert errors["reference"].startswith(want), errors


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("interpret", BACKENDS)
def test_bound_copies_refuse_strided_buffers_at_bind_and_strided_indices_per_call(monkeypatch, kind, interpret):
    _backend(monkeypatch, interpret)
    pools = _pools(kind, "d2h")
    names = _names(kind, "d2h")
    with pytest.raises(ValueError, match=rf"^{names['host']} rows must be dense"):
        _bind(pools, host=_sparse_rows(pools.host))
    devs = list(pools.devs)
    devs[1] = _non_contiguous_layer(devs[1])
    with pytest.raises(ValueError, match=rf"^{re.escape(names['dev'])} must be contiguous"):
        _bind(pools, devs=devs)
    copies = _bind(pools)
    before = _snapshot(pools)
    for dl, hl, name in ((_strided(GOOD_DL), GOOD_HL, "device_locs"), (GOOD_DL, _strided(GOOD_HL), "host_locs")):
        with pytest.raises(ValueError, match=rf"^{name} must be contiguous"):
            copies.backup(dl, hl)
        with pytest.raises(ValueError, match=rf"^{name} must be contiguous"):
            copies.load(1, dl, hl)
    assert _unchanged(pools, before)
    copies.backup(GOOD_DL, GOOD_HL)  # the good call still copies
    assert not _unchanged(pools, before)


# ----------------------------------------------------------------------------- one write per destination page
DUPLICATES = [
    # (direction, device pages, host pages, message start)
    pytest.param("d2h", [0, 2], [3, 3], "host_locs names host page 3 more than once", id="backup-host-page-twice"),
    pytest.param("d2h", [0, 1, 2, 4], [5, 0, 5], "host_locs names host page 5 more than once",
                 id="backup-host-page-twice-apart"),
    pytest.param("h2d", [2, 1, 2], [0, 1], "device_locs names logical page 2 more than once",
                 id="load-device-page-twice"),
]


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("direction,dev_pages,host_pages,message", DUPLICATES)
def test_a_destination_page_named_twice_is_refused_on_both_backends(
    monkeypatch, debug, kind, direction, dev_pages, host_pages, message
):
    """CPU indices are read for free: refused in and out of debug mode, by
    the four copies and by bound copies, with one message, nothing written."""
    monkeypatch.setenv(DEBUG_ENV, debug)
    dl, hl = page_locs(dev_pages, P), page_locs(host_pages, P)
    errors = set()
    for interpret in (None, "1"):
        _backend(monkeypatch, interpret)
        pools = _pools(kind, direction)
        before = _snapshot(pools)
        with pytest.raises(ValueError) as info:
            _call(pools, direction, dl, hl)
        errors.add(str(info.value))
        copies = _bind(pools)
        with pytest.raises(ValueError) as info:
            copies.backup(dl, hl) if direction == "d2h" else copies.load(1, dl, hl)
        errors.add(str(info.value))
        assert _unchanged(pools, before), "a refused call wrote something"
    assert len(errors) == 1 and errors.pop().startswith(message)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("interpret", BACKENDS)
def test_a_load_may_read_one_host_page_twice(monkeypatch, kind, interpret):
    """Reading a source page twice is no race: two device pages get its bytes."""
    _backend(monkeypatch, interpret)
    pools = _pools(kind, "h2d")
    dl, hl = page_locs([0, 2], P), page_locs([4, 4], P)
    want = pools.clone()
    run_oracle(want, "h2d", dl, hl, layer_id=1)
    _call(pools, "h2d", dl, hl)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(pools.dev_bigs, want.dev_bigs))
    layer = bits(pools.devs[1])
    first, second = (layer[0:P], layer[P:2 * P]) if pools.kv else (layer[0], layer[1])  # physical pages 0, 1
    assert torch.equal(first, second) and not bool((first == 0xA5).all())


@pytest.mark.parametrize("debug,checked", [("0", False), ("1", True)])
def test_cuda_indices_are_checked_for_repeated_pages_in_debug_mode_only(monkeypatch, debug, checked):
    """Off the CPU the launcher reads indices only in debug mode (reading them
    is a device sync); then the repeated-page check runs with the direction."""
    monkeypatch.setenv(DEBUG_ENV, debug)
    seen = []
    monkeypatch.setattr(_checks, "check_indices", lambda *a, **k: seen.append(k))
    meta = page_locs([0, 2], P).to("meta")  # indices that live off the CPU
    _triton_launch._check_indices(meta, meta, RANK0, 5, 6, to_host=True)
    _triton_launch._check_indices(meta, meta, RANK0, 5, 6, to_host=False)
    assert seen == ([{"to_host": True}, {"to_host": False}] if checked else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_backup_naming_a_host_page_twice_is_refused_in_debug_mode(monkeypatch, kind):
    monkeypatch.setenv(DEBUG_ENV, "1")
    pools = _pools(kind, "d2h")
    devs = [d.cuda() for d in pools.devs]
    host = pools.host.contiguous().pin_memory()
    dl, hl = page_locs([0, 2], P).cuda(), page_locs([3, 3], P).cuda()
    with pytest.raises(ValueError, match="^host_locs names host page 3 more than once"):
        _call(pools, "d2h", dl, hl, devs=devs, host=host)

