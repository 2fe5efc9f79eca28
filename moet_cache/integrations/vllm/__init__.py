"""The vLLM integration: the `moet` quantization method, the `--load-format moet` model loader and the
reasoning/tool parsers. Its modules import vLLM; this package's own import does not, so that the engine
can find a module here (importlib.util.find_spec) without importing vLLM.
"""
