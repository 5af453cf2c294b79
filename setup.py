"""Build mrtpo_kernels and its native extensions.

- ``mrtpo_kernels._C``: the C++ CPU kernels (csrc/cpu), always built.
- ``mrtpo_kernels._cuda``: the CUDA kernels (csrc/cuda), built where torch is a CUDA build
  and nvcc is found.

Environment knobs:
    MRTPO_SKIP_CUDA_BUILD=1   never build the CUDA extension
    MRTPO_SKIP_CPU_BUILD=1    do not build the CPU extension (bench/gpu_check.sh)
    MRTPO_FORCE_CUDA=1        build it even if torch sees no GPU (needs a CUDA torch + nvcc)
    MRTPO_CUDA_ARCHS="90"     semicolon-separated compute capabilities (default 90: H100/H200)
    MAX_JOBS=N                parallel compile jobs (ninja)
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def extensions():
    from torch.utils import cpp_extension

    exts = []
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    if cpu_sources and not _flag("MRTPO_SKIP_CPU_BUILD"):
        cxx = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
        exts.append(
            cpp_extension.CppExtension(
                "mrtpo_kernels._C",
                cpu_sources,
                include_dirs=[os.path.join(HERE, "csrc", "cpu")],
                extra_compile_args={"cxx": cxx},
                extra_link_args=["-fopenmp"],
            )
        )
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu"))) + sorted(
        glob.glob(os.path.join("csrc", "cuda", "*.cpp"))
    )
    want_cuda = not _flag("MRTPO_SKIP_CUDA_BUILD") and cuda_sources
    if want_cuda:
        import torch

        have_nvcc = cpp_extension.CUDA_HOME is not None
        if (
            torch.version.cuda
            and have_nvcc
            and (torch.cuda.is_available() or _flag("MRTPO_FORCE_CUDA"))
        ):
            archs = os.environ.get("MRTPO_CUDA_ARCHS", "90").replace(",", ";").split(";")
            gencode = []
            for a in filter(None, archs):
                a = a.strip().replace(".", "")
                gencode += [f"-gencode=arch=compute_{a},code=sm_{a}"]
            exts.append(
                cpp_extension.CUDAExtension(
                    "mrtpo_kernels._cuda",
                    cuda_sources,
                    include_dirs=[os.path.join(HERE, "csrc", "cuda")],
                    extra_compile_args={
                        "cxx": ["-O3", "-std=c++20"],
                        "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"] + gencode,
                    },
                )
            )
        elif _flag("MRTPO_FORCE_CUDA"):
            sys.exit("MRTPO_FORCE_CUDA=1 but torch is not a CUDA build or nvcc was not found")
    return exts


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(ext_modules=extensions(), cmdclass=cmdclass())
