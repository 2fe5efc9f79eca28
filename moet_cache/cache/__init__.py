"""The cache: its records and files, the one commit protocol, and what a cache holds.

    manifest       the records (COMMIT.json, cache.json, layer manifests, delta index, parts) and their strict reading
    layout         where each file lives in a cache folder, and the tensor names inside them (Role)
    geometry       a served layer's tensor shapes and byte counts
    cacheview      a committed cache, opened and checked once, with typed accessors
    commit         uncommit, write, commit, record, restore: every command that changes a cache
    folders        what a folder named as a cache holds: none, a file, a checkpoint, a cache
    stread         a cache file's tensors read by pread, never mapped
    tiering        the delta tier's choice under a byte budget
    quality_curve  the reference model's KL by tier size (quality_curve.json, packaged beside it)
    quant_block    the `moet` quantization_config block of the model folder's config.json
    inspection     what a cache holds, per layer and in total, from its manifests alone
Import from the modules: this package's start stays light (no numpy) for the CLI's boot check.
"""
