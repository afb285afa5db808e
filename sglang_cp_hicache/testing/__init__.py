"""CPU harness for tests and the simulator: never imported by production code.

* :mod:`.cpu_support` -- SGLang 0.5.18's host pools on a machine without CUDA
  (host-register no-op, CPU copies for non-CP stacks) and the one torchvision
  stand-in;
* :mod:`.env` -- ServerArgs, runtime-context and process-group helpers;
* :mod:`.stack` -- builds one CP rank's real SGLang stack on CPU.
"""
