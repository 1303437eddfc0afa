"""Error messages of the C++ ops reach Python intact.

On the lent H200 (torch 2.11 image) an op whose error message streamed a double crashed
the process (SIGSEGV) instead of raising; messages now format doubles with snprintf
(``format_double`` in csrc/ops/common.h). One real error per kind is raised end to end
here, on the CPU in CI and on the GPU machine by scripts/device_gpu_tests.sh.
"""
import pytest
import torch

from lrmoe import ops


@pytest.mark.parametrize("call,match", [
    (lambda: ops.quota(torch.tensor([4, 2, 3], dtype=torch.int32), 1.0),
     r"recalibration_rate must be in \[0, 1\), got 1 "),
    (lambda: ops.quota(torch.tensor([4, 2, 3], dtype=torch.int32), float("nan")),
     "got nan"),
    (lambda: ops.gather_rows(torch.randn(4, 8), torch.zeros(3, dtype=torch.int64)), "index"),
    (lambda: ops.select(torch.rand(4), torch.arange(4, dtype=torch.int32),
                        torch.tensor([4], dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32), 3), "num_retained"),
])
def test_op_errors_reach_python(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()
