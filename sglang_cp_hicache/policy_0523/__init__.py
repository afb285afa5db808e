"""Policy of the SGLang 0.5.23 adapter, in plain Python / torch only (no
sglang import), testable with integers.

``host_room`` -- which host leaves to evict so a sharded backup's owner-cyclic
run of host pages fits (only leaves that free a page of a short owner class,
or stand between the run and such a page); ``device_free`` -- a freed cyclic
run of device pages split by owner class from its first class, with
fixed-shape device work (no host read of device locs). The adapter
(``sglang_cp_hicache.sglang_0523``) applies them to upstream's objects.
"""
