"""Helpers of the SGLang 0.5.23 suite (``tests/sglang_0523``): the rank
process runners (:mod:`.ranks`, :mod:`.rank_pool`), what each rank runs
(the ``*scenarios*`` modules, :mod:`.machine_rank`). They import SGLang
0.5.23 only inside functions, so importing them elsewhere costs nothing."""
