"""Import stub for flash_attn (a CUDA-only package); see tests/framework_stubs/README.md."""


def _unavailable(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flash_attn.{name}: import stub, flash_attn needs a CUDA build")

    fn.__name__ = name
    return fn
