"""``sglang-cp-hicache fleet``: several simulated deployments (mixed CP sizes
and releases, each one ``simulate`` run in its release's interpreter) behind
a router, sharing one L3 or each with its own.

Modules: :mod:`.cli` (flags, exit status), :mod:`.spec` (``--deployment``),
:mod:`.router` (round-robin, least-loaded, prefix-affinity),
:mod:`.coordinator` (starts the deployments, releases requests in trace
order), :mod:`.feed` (the named pipes to each deployment's ranks),
:mod:`.report` (JSON and table), :mod:`.l3` (the L3: a file directory or
a Mooncake cluster, its masters), :mod:`.store_size` (a file L3's size while
it runs), :mod:`.plot` (``--plot``).
"""
