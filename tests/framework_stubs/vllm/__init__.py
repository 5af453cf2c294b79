"""Import stub for vllm (GPU-only wheels); see tests/framework_stubs/README.md."""

__version__ = "0+stub"


def _unavailable(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"vllm.{name}: import stub, vllm needs a GPU build")

    fn.__name__ = name
    return fn


AsyncEngineArgs = _unavailable("AsyncEngineArgs")
AsyncLLMEngine = _unavailable("AsyncLLMEngine")
LLM = _unavailable("LLM")
SamplingParams = _unavailable("SamplingParams")
