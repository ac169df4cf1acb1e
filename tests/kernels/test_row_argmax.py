"""`row_argmax` picks the token `torch.argmax` picks, ties and NaN included."""

import pytest
import torch

from blockdraft.kernels import ENV
from blockdraft.kernels.row_argmax import row_argmax


@pytest.mark.parametrize("shape", [(4096,), (7, 4096), (3, 2, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_torch_argmax_with_ties(shape, dtype):
    g = torch.Generator().manual_seed(0)
    # few distinct values: most rows have their maximum several times (first index wins)
    x = torch.randint(0, 5, shape, generator=g).to(dtype)
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
    assert torch.equal(got, x.argmax(-1))


def test_non_contiguous_rows_and_nan():
    x = torch.randn(300, 6, generator=torch.Generator().manual_seed(1)).t()[:, ::2]  # strided
    x[3, 7] = float("nan")
    assert torch.equal(row_argmax(x), x.argmax(-1))


def test_other_dtypes_and_autograd_keep_torch(monkeypatch):
    z = torch.randn(3, 64, requires_grad=True)
    assert torch.equal(row_argmax(z), z.argmax(-1))
    b = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(row_argmax(b), b.argmax(-1))
    calls = []
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self, *a: calls.append(1))
    monkeypatch.setenv(ENV, "0")  # the CPU kernels switched off: torch's argmax
    x = torch.randn(2, 64)
    assert torch.equal(row_argmax(x), x.argmax(-1)) and not calls
