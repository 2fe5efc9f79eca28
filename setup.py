"""The optional C kernels; all other metadata lives in pyproject.toml.

optional=True: where no C compiler is available the build goes on without moet_cache.codec._kernels and
moet_cache.codec.planes uses its numpy kernels instead, and without moet_cache._preads, whose strided reads
moet_cache.load.reads then makes in Python.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "moet_cache.codec._kernels",
            ["moet_cache/codec/_kernels.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension(
            "moet_cache._preads",
            ["moet_cache/_preads.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
    ]
)
