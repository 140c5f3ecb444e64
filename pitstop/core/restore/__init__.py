"""Putting one checkpoint back into live objects: checked first, then written, then applied.

A restore runs in four phases, so that a restore refused for any reason that can be known
without the data leaves the target exactly as it was:

1. **plan** (manifest only): match every key of the target against the checkpoint (arrays by
   shape and dtype, values by kind), decode the checkpoint's values, decide which subtrees
   are rebuilt from the checkpoint (an empty container that has filled since, an adapter
   with ``replace_on_mismatch``), and refuse a target whose shape differs at the root.
2. **check** (still no data written): every array leaf that will be written says whether
   it can be (``check_restorable``: read-only, elements sharing memory), no two leaves share
   memory unless the checkpoint holds the same bytes for both (tied weights), every entry
   that must be replaced sits in a container that can take it, and every adapter whose
   object is restored checks the checkpoint's subtree (``check``: parameter groups,
   dataset length, generator kind...).
3. **data**: fresh arrays (rebuilt subtrees, numpy scalars) are read first, then every other
   array streams straight into its live buffer, each verified against its hash. Corruption
   found here raises :class:`CorruptCheckpointError` listing what was already overwritten.
4. **apply**: values are merged into the live containers in place (same dict, list,
   OrderedDict, defaultdict; tuples and namedtuples rebuilt as their own type and put back
   into their parent), numpy scalars replaced, and adapters' ``apply`` called innermost first.


The modules follow the flow: :mod:`.plan` (1), :mod:`.check` (2), :mod:`.data` (3),
:mod:`.apply` (4), with :mod:`.merge` (putting values back), :mod:`.keys` (key paths) and
:mod:`.report` (what a restore reports). :mod:`.read` holds :class:`CheckpointReader`, one
committed checkpoint: its manifest opened and authenticated, ``load``, ``verify`` and
``restore_into`` (the four phases in order), over :mod:`.stream` (arrays read,
hash-verified) and :mod:`.files` (its data files).
"""
