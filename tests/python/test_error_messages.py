"""Error messages of the C++ ops reach Python intact.

torch 2.11 (the lent H200's build) crashed with SIGSEGV translating a c10::Error whose
message held a '%' (printf-style formatting of the message); 2.13 did not. A message
with '%' in any C++ source is therefore refused here, and one real error per op family
is raised end to end.
"""
import pathlib
import re

import pytest
import torch

from lrmoe import ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def test_no_percent_sign_in_cpp_string_literals():
    bad = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in {".h", ".cuh", ".cpp", ".cu"}:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if any("%" in s for s in STRING.findall(code)):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "'%' in C++ string literals:\n" + "\n".join(bad)


@pytest.mark.parametrize("call,match", [
    (lambda: ops.quota(torch.tensor([4, 2, 3], dtype=torch.int32), 1.0), "recalibration_rate"),
    (lambda: ops.gather_rows(torch.randn(4, 8), torch.zeros(3, dtype=torch.int64)), "index"),
    (lambda: ops.select(torch.rand(4), torch.arange(4, dtype=torch.int32),
                        torch.tensor([4], dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32), 3), "num_retained"),
])
def test_op_errors_reach_python(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()
