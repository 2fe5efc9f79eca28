"""Formats: what a checkpoint's names and numbers mean, before any cache exists.

    families     naming families: where a checkpoint keeps its routed experts, its MoE layers, its drafters
    formats      the experts' weight formats (ModelOpt, compressed-tensors, MXFP4) and the base planes' scale forms
    modelconfig  the config.json keys that decide the MoE layers and the tensor shapes
    fp4          E2M1 code maths: the value table, nibble packing
Import from the modules: this package's start stays light (no numpy) for the CLI's boot check.
"""
