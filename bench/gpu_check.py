"""GPU checks of the CP page-copy kernels, run by ``bench/gpu_check.sh``.

``checks`` (writes ``checks.json``, exit 1 on any failure):

* round trip through all four kernels -- KV backup + per-layer load and
  indexer backup + per-layer load, fp8 and bf16 KV -- at CP 1, 2 and 8 (every
  rank), all three host layouts, on host buffers allocated two ways: a plain
  CPU tensor registered with ``cudaHostRegister`` (how SGLang allocates its
  host pools) and ``pin_memory=True``. Each copy is compared bit for bit with
  the torch reference run on CPU copies of the same buffers (poisoned
  destinations, so a missed or stray write shows), and every restored page
  with the page it was backed up from;
* the four copies through ``kernels.transfer`` under
  ``torch.cuda.set_sync_debug_mode("error")`` on fresh device layers (the
  layer-address table is built inside the check): any device->host sync on
  the copy path raises.

``--device cpu`` runs the same round trips on CPU tensors (Triton's
interpreter when ``TRITON_INTERPRET=1``, else the reference) with plain host
buffers and smaller pools, to test this script without a GPU; it records
``"device": "cpu"`` and never claims a GPU result.

``env`` writes ``env.json`` (versions, GPU, whether SGLang imports).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import zlib
from dataclasses import dataclass

import torch

from sglang_cp_hicache.kernels import HOST_LAYOUTS, reference, transfer
from sglang_cp_hicache.placement import DSA_PAGE_SIZE, CpPlacement

POISON = 0xA5
# buffer -> (kv?, dtype, row elements given page_size)
KINDS = {
    "kv_fp8": (True, torch.uint8, lambda p: 656),
    "kv_bf16": (True, torch.bfloat16, lambda p: 576),
    "indexer": (False, torch.uint8, lambda p: 132 * p),
}
CP_SIZES = (1, 2, 8)


@dataclass(frozen=True)
class Geometry:
    """Pool sizes of one check run."""

    page_size: int
    num_layers: int
    dev_pages: int  # physical pages per device layer
    host_pages: int
    num_pages: int  # logical pages per backup


GPU_GEOMETRY = Geometry(DSA_PAGE_SIZE, 3, 40, 44, 37)
CPU_GEOMETRY = Geometry(16, 2, 12, 14, 11)


# ----------------------------------------------------------------------------- host buffers
class HostBuffer:
    """A host pool buffer: ``pinned`` (pin_memory=True), ``registered``
    (plain tensor + cudaHostRegister, like SGLang) or ``plain`` (CPU mode)."""

    def __init__(self, shape, dtype, alloc: str):
        self.alloc = alloc
        if alloc == "pinned":
            self.tensor = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            self.tensor = torch.empty(shape, dtype=dtype)
        if alloc == "registered":
            t = self.tensor
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")

    def close(self) -> None:
        if self.alloc == "registered":
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


def host_shape(kind: str, host_layout: str, g: Geometry) -> tuple:
    kv, _, row_of = KINDS[kind]
    row, P, L, H = row_of(g.page_size), g.page_size, g.num_layers, g.host_pages
    if kv:
        return {"layer_first": (L, H * P, 1, row), "page_first": (H * P, L, 1, row),
                "page_first_direct": (H, L, P, 1, row)}[host_layout]
    return (L, H, row) if host_layout == "layer_first" else (H, L, 1, row)


def device_layers(kind: str, g: Geometry, device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    kv, dtype, row_of = KINDS[kind]
    row = row_of(g.page_size)
    elem = torch.empty((), dtype=dtype).element_size()
    shape = (g.dev_pages * g.page_size, 1, row * elem) if kv else (g.dev_pages, row * elem)
    out = []
    for _ in range(g.num_layers):
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
        out.append(raw.view(dtype))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------- batches
def owner_mix_batch(g: Geometry, placement: CpPlacement, gen: torch.Generator, host_pages=None):
    """``g.num_pages`` logical pages as groups of cp_size consecutive pages (one
    per owner, round robin) scattered over the pool; the owned ones get
    ``host_pages`` (default: scattered ones). Returns (device_locs, host_locs,
    owned logical pages, host pages), CPU int64."""
    n, r, P = placement.cp_size, placement.cp_rank, g.page_size
    groups = torch.randperm(g.dev_pages, generator=gen)[: -(-g.num_pages // n)]
    logical = (groups[:, None] * n + torch.arange(n)).flatten()[: g.num_pages]
    owned = logical[logical % n == r]
    if host_pages is None:
        host_pages = torch.randperm(g.host_pages, generator=gen)[: owned.numel()]
    to_locs = lambda pages: (pages[:, None] * P + torch.arange(P)).flatten().to(torch.int64)
    return to_locs(logical), to_locs(host_pages), owned, host_pages


def page_of(t: torch.Tensor, kind: str, phys: int, P: int) -> torch.Tensor:
    return t[phys * P : (phys + 1) * P] if KINDS[kind][0] else t[phys]


# ----------------------------------------------------------------------------- round trip
def _backup(kind, devs, host, hl, dl, hlocs, placement, fns):
    if KINDS[kind][0]:
        fns.backup_kv_all_layers(devs, host, hl, dl, hlocs, placement)
    else:
        fns.backup_indexer_all_layers(devs, host, hl, dl, hlocs, placement)


def _load(kind, dev, host, hl, layer, dl, hlocs, placement, fns):
    if KINDS[kind][0]:
        fns.load_kv_one_layer(dev, host, hl, layer, dl, hlocs, placement)
    else:
        fns.load_indexer_one_layer(dev, host, hl, layer, dl, hlocs, placement)


class _Reference:
    """The reference under the dispatcher's names."""

    backup_kv_all_layers = staticmethod(reference.backup_kv_all_layers_reference)
    load_kv_one_layer = staticmethod(reference.load_kv_one_layer_reference)
    backup_indexer_all_layers = staticmethod(reference.backup_indexer_all_layers_reference)
    load_indexer_one_layer = staticmethod(reference.load_indexer_one_layer_reference)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def roundtrip(kind: str, hl: str, placement: CpPlacement, host: HostBuffer, g: Geometry,
              device: torch.device, seed: int) -> str | None:
    """None if every byte is right, else what differed."""
    gen = torch.Generator().manual_seed(seed)
    P = g.page_size
    devs = device_layers(kind, g, device, gen)
    h = host.tensor
    bits(h).fill_(POISON)
    dl, hlocs, owned, host_pages = owner_mix_batch(g, placement, gen)

    # D2H, all layers: the kernel vs the reference on CPU copies
    want_host = h.clone()
    _backup(kind, [d.cpu() for d in devs], want_host, hl, dl, hlocs, placement, _Reference)
    _backup(kind, devs, h, hl, dl.to(device), hlocs.to(device), placement, transfer)
    _sync(device)
    if not torch.equal(bits(h), bits(want_host)):
        return f"backup: host bytes differ from the reference ({int((bits(h) != bits(want_host)).sum())} bytes)"
    if owned.numel() and bool((bits(h) == POISON).all()):
        return "backup: nothing was written"

    # H2D, layer by layer, into other logical pages of the same owner
    dl2, hlocs2, owned2, _ = owner_mix_batch(g, placement, gen, host_pages=host_pages)
    assert owned2.numel() == owned.numel()
    originals = [d.clone() for d in devs]
    for d in devs:
        bits(d).fill_(POISON)
    want_devs = [d.to("cpu", copy=True) for d in devs]  # a copy even when devs are on the CPU
    for layer in range(g.num_layers):
        _load(kind, want_devs[layer], h, hl, layer, dl2, hlocs2, placement, _Reference)
        _load(kind, devs[layer], h, hl, layer, dl2.to(device), hlocs2.to(device), placement, transfer)
    _sync(device)
    for layer, (got, want) in enumerate(zip(devs, want_devs)):
        if not torch.equal(bits(got).cpu(), bits(want)):
            return f"load: device layer {layer} differs from the reference"
    n = placement.cp_size
    for layer in range(g.num_layers):
        for old, new in zip(owned.tolist(), owned2.tolist()):
            a = page_of(originals[layer], kind, old // n, P)
            b = page_of(devs[layer], kind, new // n, P)
            if not torch.equal(bits(a), bits(b)):
                return f"round trip: layer {layer} logical page {old} -> {new} not restored"
    return None


def run_roundtrips(device: torch.device, g: Geometry, allocs: list[str], cp_sizes, kinds, layouts) -> dict:
    results: dict[str, object] = {}
    for alloc in allocs:
        for kind in kinds:
            for hl in layouts:
                host = HostBuffer(host_shape(kind, hl, g), KINDS[kind][1], alloc)
                try:
                    if alloc != "plain":  # the launchers require is_pinned() on CUDA
                        results[f"{alloc}/{kind}/{hl}/is_pinned"] = bool(host.tensor.is_pinned())
                    for n in cp_sizes:
                        for r in range(n):
                            key = f"{alloc}/{kind}/{hl}/cp{n}/rank{r}"
                            try:
                                err = roundtrip(kind, hl, CpPlacement(g.page_size, n, r), host, g, device,
                                                seed=zlib.crc32(key.encode()))
                                results[key] = True if err is None else err
                            except Exception as exc:  # noqa: BLE001 -- recorded, the run goes on
                                results[key] = f"raised {exc!r}"[:500]
                finally:
                    host.close()
    return results


# ----------------------------------------------------------------------------- no sync
def run_sync_free(device: torch.device, g: Geometry, allocs: list[str]) -> dict:
    """All four copies through the dispatcher under sync debug mode "error",
    on fresh device layers (new layer-address table), CP 8 rank 3 and CP 1."""
    results: dict[str, object] = {}
    for alloc in allocs:
        for kind in KINDS:
            for hl in HOST_LAYOUTS:
                for n, r in ((1, 0), (8, 3)):
                    key = f"{alloc}/{kind}/{hl}/cp{n}"
                    placement = CpPlacement(g.page_size, n, r)
                    gen = torch.Generator().manual_seed(n)
                    host = HostBuffer(host_shape(kind, hl, g), KINDS[kind][1], alloc)
                    try:
                        devs = device_layers(kind, g, device, gen)
                        dl, hlocs, _, _ = owner_mix_batch(g, placement, gen)
                        dl, hlocs = dl.to(device), hlocs.to(device)
                        _sync(device)
                        torch.cuda.set_sync_debug_mode("error")
                        try:
                            _backup(kind, devs, host.tensor, hl, dl, hlocs, placement, transfer)
                            for layer in range(g.num_layers):
                                _load(kind, devs[layer], host.tensor, hl, layer, dl, hlocs, placement, transfer)
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                        _sync(device)
                        results[key] = True
                    except Exception as exc:  # noqa: BLE001
                        results[key] = f"raised {exc!r}"[:500]
                    finally:
                        host.close()
    return results


# ----------------------------------------------------------------------------- commands
def env_info() -> dict:
    import triton

    info = dict(python=sys.version.split()[0], platform=platform.platform(), torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                triton_interpret=os.environ.get("TRITON_INTERPRET"))
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    try:
        # the test suite's own way in: a torchvision stand-in only if needed
        from sglang_cp_hicache.testing.cpu_support import ensure_sglang_importable

        info["torchvision_standin"] = ensure_sglang_importable()
        import sglang

        info["sglang"] = getattr(sglang, "__version__", "importable")
    except Exception as exc:  # noqa: BLE001 -- any import failure means "not usable"
        info["sglang"] = None
        info["sglang_error"] = repr(exc)[:300]
    return info


def failures(results: dict) -> list[str]:
    return [k for k, v in results.items() if not k.endswith("/is_pinned") and v is not True]


def cmd_checks(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (use --device cpu to test this script)", file=sys.stderr)
        return 2
    g = GPU_GEOMETRY if device.type == "cuda" else CPU_GEOMETRY
    allocs = ["registered", "pinned"] if device.type == "cuda" else ["plain"]
    cp_sizes = args.cp_sizes or list(CP_SIZES)
    kinds = args.kinds or list(KINDS)
    layouts = args.host_layouts or list(HOST_LAYOUTS)
    out = {"device": str(device), "backend": transfer.select_backend(device), "geometry": g.__dict__}
    t0 = time.perf_counter()
    transfer.reset_copy_stats()
    out["roundtrip"] = run_roundtrips(device, g, allocs, cp_sizes, kinds, layouts)
    out["roundtrip_seconds"] = round(time.perf_counter() - t0, 2)
    if device.type == "cuda":
        t0 = time.perf_counter()
        out["sync_free"] = run_sync_free(device, g, allocs)
        out["sync_free_seconds"] = round(time.perf_counter() - t0, 2)
    out["copy_stats"] = transfer.copy_stats().as_dict()
    bad = failures(out["roundtrip"]) + failures(out.get("sync_free", {}))
    registered_unpinned = [k for k, v in out["roundtrip"].items() if k.endswith("/is_pinned") and v is not True]
    out["failures"] = bad + registered_unpinned
    out["ok"] = not out["failures"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "checks.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"checks: {'OK' if out['ok'] else 'FAILED'}; {len(out['roundtrip'])} round-trip entries, "
          f"{len(out.get('sync_free', {}))} sync-free entries; failures: {out['failures'][:10]}")
    return 0 if out["ok"] else 1


def cmd_env(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    info = env_info()
    with open(os.path.join(args.out, "env.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="write env.json")
    e.add_argument("--out", required=True)
    c = sub.add_parser("checks", help="round trips + sync-free launches; write checks.json")
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="cuda", help="cuda (default) or cpu (tests this script)")
    split = lambda s: s.split(",")
    c.add_argument("--cp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    c.add_argument("--kinds", type=split, default=None)
    c.add_argument("--host-layouts", type=split, default=None)
    args = ap.parse_args(argv)
    try:
        return cmd_env(args) if args.cmd == "env" else cmd_checks(args)
    except Exception:  # noqa: BLE001 -- the shell script records the traceback in the stage log
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
