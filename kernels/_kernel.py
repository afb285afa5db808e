"""The Triton kernel: masked per-rank page copies between SGLang host pools and
DSA device pools under CP shared KV.

One kernel, ``_copy_pages_kernel``, moves whole pages in either direction:

* backup (``d2h``, all layers): device layers are separate allocations, so the
  kernel reads their addresses from a small int64 table;
* load (``h2d``, one layer): the one device layer is passed directly.

The kernel takes LOGICAL ``device_locs``. The k-th page of ``device_locs``
that this rank owns goes to host page ``host_locs[k * page_size] //
page_size``; pages other ranks own are skipped, owned ones translated to
physical pages. No device-to-host sync and no extra torch kernels: every
program finds its own k.

How a program works (``num_ctas`` programs, persistent-style):

1. It takes a contiguous chunk of pages (and, for backups with fewer pages
   than programs, a chunk of layers) and counts the owned pages ahead of its
   chunk, ``COUNT_PAGES`` page locations per vector step.
2. It walks its chunk ``WALK_PAGES`` pages at a time: one vector load of their
   locations, an owned mask and its prefix sum give every owned page its host
   slot (one gather of ``host_locs``). Foreign pages cost one lane each, never
   a serial step.
3. It copies the copyable pages of the walk block as a stream of tiles. A
   tile is ``TILE_PAGES`` units of ``TILE_WORDS`` words, a unit being one
   ``TILE_WORDS`` chunk of one layer of one page, so one tile can hold several
   small (8,448-byte indexer) pages or the chunks of one large page. The tile
   loop is software-pipelined: the next tile's load is issued before the
   current tile is stored, so two tiles are in flight per program.

Owners are computed with floor division, like the CPU side
(``CpPlacement``), so both agree on which pages a rank owns even for
negative locations. A page whose physical page or host page falls outside its
buffer (negative included) keeps its host slot in the pairing but is not
copied: a stray store into pinned host memory corrupts the process.

Destination pages must be distinct (host pages of a backup, owned device
pages of a load): programs copy their pages concurrently, so two copies into
one page race. The kernel does not look; the launchers refuse a repeated
destination page whenever they read the indices (CPU, or debug mode).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _triton_compat  # noqa: F401  (triton 3.6 interpreter + numpy >= 2.4)

# ----------------------------------------------------------------------------- constants
# CTAs per launch when the caller does not say. The copy is bound by the host
# link (PCIe Gen5 x16: ~55 GB/s per direction measured), not by SMs; SGLang's
# host-copy kernel reaches its link limit with 4 of 152 SMs, and copy kernels
# that take many SMs slow the forward pass. Unmeasured on these kernels yet:
# bench/bench_transfer.py sweeps it.
DEFAULT_NUM_CTAS = 4

# Bytes of one tile (the unit a program loads, then stores). Throughput over
# the host link per CTA is bytes-in-flight / latency (~1-2 us across PCIe);
# with two 32 KiB tiles in flight that is ~30-60 GB/s per CTA, so a few CTAs
# saturate the link, while a tile still fits in registers (128 B per thread
# at 8 warps, twice).
DEFAULT_BLOCK_BYTES = 32768

# Each thread holds 8 x 16-byte vectors of a tile: enough independent loads
# per thread without spilling (two tiles live at once). num_warps is
# tile bytes / (32 threads * 128 B), clamped to [1, 8].
BYTES_PER_THREAD = 128

# Widest global access on sm_90 is 16 bytes (ld.global.v4.b32 / v2.b64).
VECTOR_BYTES = 16

# Page locations per vector step when a program counts the owned pages ahead
# of its chunk: 8 KiB of int64 loads in flight per step.
COUNT_PAGES = 1024

# Pages per walk block. Every tile selects its pages from the block with a
# reduction over these lanes, so the block stays small; at CP 8 it still holds
# ~16 owned pages, enough tiles to keep the two-deep pipeline full.
WALK_PAGES = 128

# Most page units per tile: bounds the per-tile selection work (a
# TILE_PAGES x WALK_PAGES reduction) while letting 8,448-byte indexer pages
# share a 32 KiB tile.
MAX_TILE_PAGES = 16


# ----------------------------------------------------------------------------- flavour
# A twin loader (_twin.py) loads this file a second time with
# _FORCE_INTERPRET set in the module's globals, to get the flavour (compiled
# or interpreted) that Triton's TRITON_INTERPRET did not pick at import. The
# decorator is chosen here, without touching os.environ, so no other thread
# ever sees a changed environment.
def _jit(**kwargs):
    forced = globals().get("_FORCE_INTERPRET")
    if forced is None:
        return triton.jit(**kwargs)
    if forced:
        from triton.runtime.interpreter import InterpretedFunction

        return lambda fn: InterpretedFunction(fn, **kwargs)
    from triton.runtime.jit import JITFunction

    return lambda fn: JITFunction(fn, **kwargs)


# ----------------------------------------------------------------------------- helpers
# The kernel uses only triton.language builtins plus the helpers below, never
# the @triton.jit functions of triton.language.standard (tl.sum, tl.cumsum,
# tl.cdiv, ...): their flavour is fixed when triton itself is imported, while
# this file's flavour is chosen per load.
@_jit()
def _add(a, b):
    return a + b


def _is_interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


INTERPRETED = _is_interpreted(_add)

# The combine function of every sum and prefix sum. Triton's interpreter runs
# a reduction or scan whose combine function IS triton.language's own sum
# combine as one numpy call, any other element by element in Python (~10 us
# each); it never calls the function, so its flavour does not matter there.
# The compiled flavour must call a compiled function: our own _add.
_SUM = tl.standard._sum_combine if INTERPRETED else _add


@_jit()
def _floor_div(a, b):
    """``a // b`` rounded down (Triton's ``//`` truncates), for ``b > 0``."""
    q = a // b
    return q - ((a % b != 0) & (a < 0)).to(q.dtype)


@_jit()
def _floor_mod(a, b):
    """``a mod b`` in ``[0, b)`` (Triton's ``%`` keeps the dividend's sign), for ``b > 0``."""
    m = a % b
    return tl.where(m < 0, m + b, m)


@_jit()
def _owned_pages_before(
    device_locs_ptr, end_page, cp_size, cp_rank,
    PAGE_SIZE: tl.constexpr, COUNT_PAGES: tl.constexpr,
):
    """How many of pages [0, end_page) of device_locs this rank owns."""
    count = tl.full((), 0, tl.int64)
    for start in range(0, end_page, COUNT_PAGES):
        pages = start + tl.arange(0, COUNT_PAGES).to(tl.int64)
        in_range = pages < end_page
        locs = tl.load(device_locs_ptr + pages * PAGE_SIZE, mask=in_range, other=0)
        owned = in_range & (_floor_mod(_floor_div(locs, PAGE_SIZE), cp_size) == cp_rank)
        count += tl.reduce(owned.to(tl.int64), 0, _SUM)
    return count


@_jit()
def _tile(
    t, n_units, units_per_page, layer_lo, layer_base,
    ok, ok_rank, phys, host_page,
    dev_ptr, host_ptr, host_page_stride, host_layer_stride, host_row_stride,
    PAGE_WORDS: tl.constexpr, ROW: tl.constexpr, CHUNKS: tl.constexpr,
    TILE_PAGES: tl.constexpr, TILE_WORDS: tl.constexpr, ALIGN_BYTES: tl.constexpr,
    HOST_ROWS_DENSE: tl.constexpr, DEV_PTR_TABLE: tl.constexpr, TO_HOST: tl.constexpr,
):
    """Source pointers, destination pointers and mask of tile ``t``.

    Unit ``u = t * TILE_PAGES + row`` is chunk ``u % CHUNKS`` of layer
    ``layer_lo + (u // CHUNKS) % layers`` of the ``u // units_per_page``-th
    copyable page of the walk block (pages outer, so a backup streams every
    layer of a page before the next page).
    """
    unit = t * TILE_PAGES + tl.arange(0, TILE_PAGES).to(tl.int64)
    valid = unit < n_units
    k = unit // units_per_page
    rest = unit % units_per_page
    layer = layer_lo + rest // CHUNKS
    chunk = rest % CHUNKS
    # the k-th copyable lane of the walk block, picked by a masked sum
    sel = ok[None, :] & (ok_rank[None, :] == k[:, None] + 1)
    phys_k = tl.reduce(tl.where(sel, phys[None, :], 0), 1, _SUM)
    host_k = tl.reduce(tl.where(sel, host_page[None, :], 0), 1, _SUM)
    if DEV_PTR_TABLE:
        layer_addr = tl.load(dev_ptr + layer, mask=valid, other=0)
        dev_layer = layer_addr.to(tl.pointer_type(host_ptr.dtype.element_ty))
    else:
        dev_layer = dev_ptr
    # The alignment hint sits on the row addresses (a hint on a kernel
    # argument itself is dropped); the launcher checked it.
    dev_row = tl.multiple_of(dev_layer + phys_k * PAGE_WORDS, ALIGN_BYTES)
    host_row = tl.multiple_of(
        host_ptr + host_k * host_page_stride + (layer_base + layer) * host_layer_stride, ALIGN_BYTES
    )
    col = chunk[:, None] * TILE_WORDS + tl.arange(0, TILE_WORDS)[None, :]
    mask = valid[:, None] & (col < PAGE_WORDS)
    # The device page is PAGE_WORDS contiguous words. Host rows are dense too
    # (layer_first, page_first_direct, indexer) or host_row_stride apart
    # (page_first KV, where the other layers of a slot sit between its rows).
    if HOST_ROWS_DENSE:
        host_col = col
    else:
        host_col = (col // ROW) * host_row_stride + col % ROW
    dev_p = dev_row[:, None] + col
    host_p = host_row[:, None] + host_col
    if TO_HOST:
        src, dst = dev_p, host_p
    else:
        src, dst = host_p, dev_p
    return src, dst, mask


# ----------------------------------------------------------------------------- kernel
@_jit(
    do_not_specialize=[
        "num_pages", "num_listed_host_pages", "dev_num_pages", "host_num_pages",
        "layer_base", "num_layers", "pages_per_program", "layers_per_program",
        "host_page_stride_v", "host_layer_stride_v", "host_row_stride_v",
        "cp_size", "cp_rank",
    ],
    # Alignment is passed explicitly (ALIGN_BYTES, checked by the launcher), so
    # a sliced index tensor or an odd host view never triggers a recompile.
    do_not_specialize_on_alignment=["dev_ptr", "host_ptr", "device_locs_ptr", "host_locs_ptr"],
)
def _copy_pages_kernel(
    dev_ptr,                # DEV_PTR_TABLE: int64 byte addresses of each device layer;
                            # else the one device layer (words)
    host_ptr,               # host buffer (words), at its first page and layer
    device_locs_ptr,        # int64 logical token locs, whole pages
    host_locs_ptr,          # int64 host slots of the owned tokens, whole pages
    num_pages,              # pages in device_locs
    num_listed_host_pages,  # pages in host_locs
    dev_num_pages,          # physical pages per device layer (bound)
    host_num_pages,         # pages in the host buffer (bound)
    layer_base,             # host layer of device layer 0
    num_layers,             # device layers to copy
    pages_per_program, layers_per_program,
    host_page_stride_v, host_layer_stride_v, host_row_stride_v,  # in VEC-word units
    cp_size, cp_rank,
    PAGE_SIZE: tl.constexpr,     # tokens per page (for the location math)
    ROWS: tl.constexpr,          # rows per copied page: PAGE_SIZE for KV, 1 for indexer
    ROW: tl.constexpr,           # words per row
    VEC: tl.constexpr,           # words per 16 bytes when every address is 16-B aligned, else 1
    ALIGN_BYTES: tl.constexpr,   # VEC * word bytes: alignment of every base address and stride
    TILE_PAGES: tl.constexpr,    # units per tile (power of two)
    TILE_WORDS: tl.constexpr,    # words per unit (power of two)
    COUNT_PAGES: tl.constexpr,
    WALK_PAGES: tl.constexpr,
    HOST_ROWS_DENSE: tl.constexpr,
    DEV_PTR_TABLE: tl.constexpr,
    TO_HOST: tl.constexpr,
):
    PAGE_WORDS: tl.constexpr = ROWS * ROW
    CHUNKS: tl.constexpr = (PAGE_WORDS + TILE_WORDS - 1) // TILE_WORDS
    pid_page = tl.program_id(0).to(tl.int64)
    pid_layer = tl.program_id(1).to(tl.int64)
    # Strides arrive in VEC-word units so the compiler can prove 16-byte
    # alignment of every address without specialising on their values.
    host_page_stride = host_page_stride_v.to(tl.int64) * VEC
    host_layer_stride = host_layer_stride_v.to(tl.int64) * VEC
    host_row_stride = host_row_stride_v.to(tl.int64) * VEC

    page_lo = pid_page * pages_per_program
    page_hi = tl.minimum(page_lo + pages_per_program, num_pages)
    layer_lo = pid_layer * layers_per_program
    layer_hi = tl.minimum(layer_lo + layers_per_program, num_layers)
    units_per_page = tl.maximum(layer_hi - layer_lo, 0) * CHUNKS

    # owned pages ahead of this chunk = host_locs pages ahead of its first owned page
    host_base = _owned_pages_before(device_locs_ptr, page_lo, cp_size, cp_rank, PAGE_SIZE, COUNT_PAGES)
    for walk_lo in range(page_lo, page_hi, WALK_PAGES):
        lanes = walk_lo + tl.arange(0, WALK_PAGES).to(tl.int64)
        in_chunk = lanes < page_hi
        locs = tl.load(device_locs_ptr + lanes * PAGE_SIZE, mask=in_chunk, other=0)
        logical_page = _floor_div(locs, PAGE_SIZE)
        owned = in_chunk & (_floor_mod(logical_page, cp_size) == cp_rank)
        owned_i = owned.to(tl.int64)
        host_idx = host_base + tl.associative_scan(owned_i, 0, _SUM) - 1
        listed = owned & (host_idx < num_listed_host_pages)
        host_loc = tl.load(host_locs_ptr + host_idx * PAGE_SIZE, mask=listed, other=0)
        host_page = _floor_div(host_loc, PAGE_SIZE)
        phys = _floor_div(logical_page, cp_size)
        ok = listed & (phys >= 0) & (phys < dev_num_pages) & (host_page >= 0) & (host_page < host_num_pages)
        ok_i = ok.to(tl.int64)
        ok_rank = tl.associative_scan(ok_i, 0, _SUM)
        n_units = tl.reduce(ok_i, 0, _SUM) * units_per_page
        host_base += tl.reduce(owned_i, 0, _SUM)
        if n_units > 0:
            # Two tiles in flight: load tile t, then store tile t - 1.
            src, dst, mask = _tile(
                0, n_units, units_per_page, layer_lo, layer_base, ok, ok_rank, phys, host_page,
                dev_ptr, host_ptr, host_page_stride, host_layer_stride, host_row_stride,
                PAGE_WORDS, ROW, CHUNKS, TILE_PAGES, TILE_WORDS, ALIGN_BYTES,
                HOST_ROWS_DENSE, DEV_PTR_TABLE, TO_HOST,
            )
            words = tl.load(src, mask=mask)
            for t in range(1, (n_units + TILE_PAGES - 1) // TILE_PAGES):
                next_src, next_dst, next_mask = _tile(
                    t, n_units, units_per_page, layer_lo, layer_base, ok, ok_rank, phys, host_page,
                    dev_ptr, host_ptr, host_page_stride, host_layer_stride, host_row_stride,
                    PAGE_WORDS, ROW, CHUNKS, TILE_PAGES, TILE_WORDS, ALIGN_BYTES,
                    HOST_ROWS_DENSE, DEV_PTR_TABLE, TO_HOST,
                )
                next_words = tl.load(next_src, mask=next_mask)
                tl.store(dst, words, mask=mask)
                words, dst, mask = next_words, next_dst, next_mask
            tl.store(dst, words, mask=mask)
