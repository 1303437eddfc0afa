"""Build of the lrmoe package and its compiled extension ``lrmoe._C``.

The extension is always built for the CPU (csrc/ops/*.cpp, the planner and simulator
of csrc/planner and csrc/sim, and their pybind11 bindings csrc/python/*.cpp). Where the installed
torch is a CUDA build and nvcc is found, the CUDA kernels (csrc/ops/*.cu) are
added, compiled for Hopper (sm_90a + sm_90) unless LRMOE_CUDA_ARCH names other
``-gencode`` targets. Set LRMOE_CUDA=0 to force a CPU-only build, LRMOE_CUDA=1
to fail loudly when CUDA cannot be built. MAX_JOBS bounds parallel compiles.
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
# torch >= 2.14 headers need C++20; older ones accept it too.
STD = "-std=" + os.environ.get("LRMOE_CXX_STD", "c++20")


def _want_cuda() -> bool:
    flag = os.environ.get("LRMOE_CUDA", "auto").lower()
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if flag in ("1", "true", "yes"):
        if not possible:
            raise RuntimeError(
                "LRMOE_CUDA=1 but the installed torch has no CUDA "
                f"(torch.version.cuda={torch.version.cuda}) or nvcc was not found "
                f"(CUDA_HOME={CUDA_HOME}); install a CUDA build of torch or unset LRMOE_CUDA")
        return True
    if flag in ("0", "false", "no"):
        return False
    return possible


def _extension():
    cpp = sorted(glob.glob(os.path.join("csrc", "ops", "*.cpp"))
                 + glob.glob(os.path.join("csrc", "planner", "*.cpp"))
                 + glob.glob(os.path.join("csrc", "sim", "*.cpp"))
                 + glob.glob(os.path.join("csrc", "python", "*.cpp")))
    # no fused multiply-add contraction: the CPU kernels then round like the CUDA ones
    # (which use explicit __fmul_rn/__fadd_rn where bit equality is tested) on every ISA;
    # GCC contracts by default where FMA exists (aarch64, x86 with -march=native)
    cxx = ["-O3", STD, "-ffp-contract=off"]
    include = [os.path.join(ROOT, "csrc")]
    # setuptools rebuilds only when a listed file is newer than the .so; ninja then
    # recompiles just the objects whose sources or headers changed.
    depends = sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True)
                     + glob.glob(os.path.join("csrc", "**", "*.cuh"), recursive=True))
    if not _want_cuda():
        return CppExtension("lrmoe._C", cpp, include_dirs=include, depends=depends,
                            extra_compile_args={"cxx": cxx})
    cu = sorted(glob.glob(os.path.join("csrc", "ops", "*.cu")))
    arch = os.environ.get(
        "LRMOE_CUDA_ARCH",
        "-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90").split()
    nvcc = ["-O3", STD, "--expt-relaxed-constexpr", "-lineinfo", *arch]
    return CUDAExtension("lrmoe._C", cpp + cu, include_dirs=include, depends=depends,
                         define_macros=[("LRMOE_WITH_CUDA", "1")],
                         extra_compile_args={"cxx": cxx, "nvcc": nvcc})


class _BuildExt(BuildExtension):
    """Object names keep the source suffix (x.cpp -> x_cpp.o, x.cu -> x_cu.o): an op's
    CPU and CUDA files share a stem, and ninja refuses two rules for one object."""

    def build_extensions(self):
        plain = self.compiler.object_filenames

        def object_filenames(sources, strip_dir=0, output_dir=""):
            objs = plain(sources, strip_dir, output_dir)
            return [f"{os.path.splitext(o)[0]}_{os.path.splitext(s)[1].lstrip('.')}"
                    f"{os.path.splitext(o)[1]}" for s, o in zip(sources, objs)]

        self.compiler.object_filenames = object_filenames
        super().build_extensions()


setup(
    packages=find_packages(include=["lrmoe", "lrmoe.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExt.with_options(use_ninja=True)},
)
