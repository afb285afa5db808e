"""L3 (HiCache storage tier) for CP-sharded KV, torch and stdlib only: the
one wing both SGLang releases share. A release hands in an
:class:`~.opening.L3Binding` and keeps two modules of its own (its port of
the prefetch protocol and its entry, where SGLang calls in).

Naming a page and its object:

* ``identity``, ``fingerprint`` -- the model identity of a server (never the
  served name); a local checkpoint's content fingerprint;
* ``keys`` -- topology-free page keys: SGLang's page hash + a digest of what
  makes the page's bytes (:class:`L3Namespace`); no CP rank or size;
* ``envelope`` -- the stored object: header (format, namespace, key,
  length, tag) + payload; ``unpack`` verifies or says why not;
* ``auth`` -- the tag: XXH3-64, or keyed BLAKE3 with a deployment secret.

Which rank does what:

* ``plan`` -- which pages of a chain each rank writes and reads (its own);
* ``consensus`` -- each rank's local usable prefix (the group agrees on the
  MIN in SGLang's own all-reduce).

Stores:

* ``store`` -- the :class:`PageStore` interface and the file store;
  ``capabilities`` -- what a store can do beyond it (read into buffers,
  write from parts, open an object, register buffers), declared as
  Protocols and found once when the tier opens the store;
* ``capacity``, ``capacity_state`` -- the bound of a shared file directory
  and its on-disk state; ``safe_files`` -- opening files in a directory
  others may write; ``clear`` -- removing a deployment's namespaces.

One rank's tier:

* ``pages`` -- one page's object stored (verified, kept or repaired) and
  read verified into the caller's buffers;
* ``host_tier`` -- one rank's L3 on a pair of host pools (KV and DSA
  indexer): snapshots, page writes, page reads into host rows;
  ``host_copy``, ``host_read`` -- the host rows of a page, and reading an
  object straight into them; ``staging`` -- staging buffers lent one page
  at a time (bounded);
* ``prefetch`` -- THE prefetch protocol (query -> MIN -> fetch -> MIN ->
  insert), with the release's five-method :class:`~.prefetch.L3Port`;
* ``writes``, ``workers`` -- writes off the scheduler thread; bounded I/O
  threads with deadlines;
* ``location`` -- where L3 lives (from SGLang's flags), deadlines;
* ``opening`` -- opening a rank's tier from a release's binding (the
  server's model identity, the Mooncake segment rule, the served stores);
* ``rank`` -- a rank's L3 at start-up and once the ranks agree (reads,
  writes, storing a node's chain, metrics, clearing);
* ``metrics``, ``storage_metrics`` -- the rank's L3 figures, the library's
  counters and SGLang's storage collector fed from them.
"""
