"""Pool sizes for a trace, from its working set (``simulate --trace`` without
``--device-pages`` / ``--host-pages``).

The rule, with U the distinct whole pages of the requests replayed (the
pages an infinite cache holds at the end: :func:`.ideal.ideal_cache`), F the
``--capacity`` fraction, N the CP size, P the page size and L the longest
request in tokens:

* host pages per rank H = max(ceil(F x U / N), MIN_POOL_PAGES): the N host
  pools together hold F of the working set;
* device pages per rank D = max(ceil(H / HOST_TO_DEVICE), ceil((ceil(L / P)
  + 1) / N), MIN_POOL_PAGES): half the host pool (SGLang's
  ``--hicache-ratio 2``, as in the README's launch line), and never too
  small for the longest request (the logical pool has N x D pages, one of
  them padding). Under ``--engine scheduler`` L also counts the request's
  new tokens, N x P and one token: SGLang's ``PrefillAdder`` admits a
  request only while more tokens are free than it will hold plus a
  per-request overhead, and never admits one that cannot fit (the run
  would wait for it forever).

An explicit ``--device-pages`` or ``--host-pages`` wins over its half of the
rule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["DEFAULT_CAPACITY", "HOST_TO_DEVICE", "MIN_POOL_PAGES", "PoolSizing", "pages_for_request", "size_pools"]

DEFAULT_CAPACITY = 0.25
#: Host pages per device page (SGLang's --hicache-ratio in the launch line).
HOST_TO_DEVICE = 2
#: Smallest pool a rank gets: a trace of a few short requests still builds a
#: stack that can hold a request and evict.
MIN_POOL_PAGES = 4


@dataclass
class PoolSizing:
    """How the pools of a trace run were sized (the summary's ``pool_sizing``)."""

    capacity: float
    distinct_pages: int  # U
    longest_request_tokens: int  # L
    device_pages: int  # per rank
    host_pages: int  # per rank
    device_from: str  # "--device-pages" or "--capacity"
    host_from: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"pools sized from the trace: {self.distinct_pages:,} distinct pages, --capacity {self.capacity:g}; "
                f"host {self.host_pages} pages per rank (from {self.host_from}), device {self.device_pages} "
                f"(from {self.device_from})")


def pages_for_request(tokens: int, cp_size: int, page_size: int) -> int:
    """Device pages per rank whose logical pool (N x D pages, one of them padding) holds ``tokens``."""
    return math.ceil((math.ceil(tokens / page_size) + 1) / cp_size)


def size_pools(
    *,
    distinct_pages: int,
    longest_request_tokens: int,
    cp_size: int,
    page_size: int,
    capacity: float,
    device_pages: Optional[int] = None,
    host_pages: Optional[int] = None,
    reserve_tokens: int = 0,
) -> PoolSizing:
    """The pools per rank by the module's rule; explicit sizes win.
    ``reserve_tokens``: what the engine needs beside the longest request."""
    host = host_pages if host_pages is not None else max(
        math.ceil(capacity * distinct_pages / cp_size), MIN_POOL_PAGES)
    fits_longest = pages_for_request(longest_request_tokens + reserve_tokens, cp_size, page_size)
    device = device_pages if device_pages is not None else max(
        math.ceil(host / HOST_TO_DEVICE), fits_longest, MIN_POOL_PAGES)
    return PoolSizing(
        capacity=capacity, distinct_pages=distinct_pages, longest_request_tokens=longest_request_tokens,
        device_pages=device, host_pages=host,
        device_from="--device-pages" if device_pages is not None else "--capacity",
        host_from="--host-pages" if host_pages is not None else "--capacity",
    )
