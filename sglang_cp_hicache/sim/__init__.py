"""Multi-rank CP HiCache simulator (torch.distributed, gloo).

``sglang-cp-hicache simulate`` starts one process per CP rank; each builds a
real SGLang stack -- 0.5.18's ``HiRadixCache`` with this library's CP cache,
or 0.5.23's KV-sharded ``UnifiedRadixCache`` with this library's or upstream's
copies (``--sglang``, ``--copy``) -- and replays the same requests, writing
deterministic KV + indexer content into the pages it owns and checking every
owned page of every matched prefix bit-exactly: by default through SGLang's
own ``Scheduler`` in each rank (``--engine scheduler``), or one request at a
time through the simulator's own loop (``--engine loop``).

Modules (none imports SGLang; the rank engines that call SGLang's cache API
are :mod:`.engine_0518` and :mod:`.engine_0523` (and
:mod:`.engine_0523_plain`, the 0.5.23 non-CP baseline), on the shared
:mod:`.engine_base`, loaded in the rank processes; the page content, the
zygote that forks the ranks and their launcher-death guard are the harness's,
:mod:`sglang_cp_hicache.testing`):

* ``workload`` -- synthetic multi-turn chat, JSONL traces
* ``mooncake`` -- Mooncake FAST'25 trace lines as requests (hash id -> block)
* ``ideal``    -- what an infinite cache would hit on the same requests
* ``sizing``   -- pool sizes from a trace's distinct pages (--capacity)
* ``rates``    -- hits per tier against the prompt and the ideal, bytes, GB/s
* ``config``   -- settings, per-process spec, the failure-injection test hook
* ``records``  -- dataclasses passed from the ranks to the launcher
* ``worker``   -- body of one rank process (or of the non-CP comparison)
* ``ranklog``  -- each process's output in an unnamed file, kept only on failure
* ``launcher`` -- spawn, watch, stop on failure, collect
* ``failures`` -- which rank failed first (the cause, not its peers' symptoms)
* ``report``   -- summary JSON, verdict, comparison with non-CP, failure message
* ``table``    -- the text report printed from the summary
* ``compare``  -- --compare-upstream: the library's and upstream's runs side by side
* ``outputs``  -- --json / --plot paths checked before a run
* ``plot``     -- PNG (matplotlib, optional)
* ``cli``      -- the ``simulate`` subcommand (its flags: ``cli_flags``; ``--engine``: ``cli_engine``)
* ``engine_scheduler`` -- ``--engine scheduler``: the workload through SGLang's real
  ``Scheduler`` (the harness in ``sglang_cp_hicache.testing.sched_*``), closed-loop arrivals
* ``engine_scheduler_fed`` -- that engine's loop in a fleet deployment: the requests its
  coordinator releases (``sim.fleet``)
* ``report_scheduler`` -- that engine's summary JSON and printed table
* ``packed``   -- many requests' token ids in two flat arrays (what every rank receives)
* ``progress`` -- start-up and replay progress on stderr
* ``copy_path_times`` -- CPU seconds of a rank's copy path, per phase
* ``l3_usage`` -- bytes a file L3 directory holds, and the most it held during a run
* ``l3_writers`` -- which run wrote the L3 objects a run restores from
* ``metrics_scrape`` -- a rank's scrape of the library's ``sglang_cp_hicache:*`` metrics
* ``extensions`` -- each SGLang release JIT-builds torch extensions in its own directory
* ``fleet``    -- (package) ``sglang-cp-hicache fleet``: deployments behind a router on one L3
"""
