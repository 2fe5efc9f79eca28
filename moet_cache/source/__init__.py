"""The source checkpoint: read, made, and written back from a cache.

    checkpoint  the one source reader every command uses: headers, config, family, formats, fingerprint
    synthetic   a small faithful DeepSeek-style FP4 checkpoint for the demo, the tests and the benchmarks
    exporter    a lossless cache turned back into a checkpoint in the source's layout
Import from the modules; `moet_cache` exports `make_checkpoint`, `export_checkpoint` and their records.
"""
