"""The codec: each FP4 code split into a 2-bit base plane and a 2-bit delta plane, and joined again.

    planes    the split (base = code >> 2 through a fitted table, delta = code & 3), histograms, error sums
    _kernels  the optional one-pass C kernel of the split (setup.py builds it where a compiler is present)
    expand    base (+ delta) planes back into packed FP4 codes for a stock NVFP4 kernel
Import from the modules.
"""
