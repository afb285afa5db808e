"""CPU harness for tests and the simulator: never imported by production code.

* :mod:`.cpu_support` -- SGLang's host pools on a machine without CUDA
  (host-register no-op, CPU copies for non-CP stacks) and the one torchvision
  stand-in (both releases);
* :mod:`.env` -- ServerArgs, runtime-context and process-group helpers;
* :mod:`.patching` -- one reversible set of patches for both CPU harnesses;
* :mod:`.stack_0518` -- one CP rank's real SGLang 0.5.18 stack on CPU;
* :mod:`.cpu_0523`, :mod:`.stack_0523` -- the same for SGLang 0.5.23's
  KV-sharded DSA pool;
* :mod:`.requests_0523` -- requests as 0.5.23's scheduler holds them;
* :mod:`.tree_nodes` -- a radix node for the 0.5.18 policy without SGLang;
* :mod:`.content` -- deterministic page content and bit-exact checks (pure torch);
* :mod:`.l3_keys` -- which pages a rank's L3 stored and restored, by page key (both engines);
* :mod:`.zygote`, :mod:`.zygote_server` -- rank processes forked from one
  interpreter that imported what they need (once per run, or one long-lived
  zygote per launching process);
* :mod:`.lifetime` -- a rank ends as soon as its launcher is gone (SIGKILL included);
* :mod:`.sched_harness` and the other ``sched_*`` -- SGLang's real ``Scheduler``
  on CPU ranks.
"""
