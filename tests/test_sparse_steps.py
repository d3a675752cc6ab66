"""Sparse tensors in a step (a sparse batch, a module that returns ``to_sparse()``): measured through their stored
values, like sparse gradients; a step that trains is diagnosed, and a non-finite stored value is seen."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


class DenseOfSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to_dense())


class Sparsify(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.to_sparse()


class ReturnsSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.sparse = Sparsify()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.sparse(x).to_dense())


def _loss(out: Any, _batch: Any) -> torch.Tensor:
    return out.float().mean()


def _batch(layout: str, poison: bool = False) -> torch.Tensor:
    x = torch.zeros(4, 6)
    x[0, 1], x[2, 3], x[3, 5] = 0.5, -1.5, float("nan") if poison else 2.0
    return x.to_sparse() if layout == "coo" else x.to_sparse_csr()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_batch_is_diagnosed(layout: str) -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(DenseOfSparse(), _batch(layout), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "healthy"


def test_a_nan_stored_in_a_sparse_batch_is_seen() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(DenseOfSparse(), _batch("coo", poison=True), loss_fn=_loss, dtype=FP16,
                                progress=False)
    assert report.verdict == "nan"
    assert report.findings.forward_origin is not None
    assert report.findings.forward_origin.module == "<batch>"


def test_a_module_returning_a_sparse_tensor_is_measured() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(ReturnsSparse(), torch.randn(4, 6), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "healthy"
    (call,) = [c for c in report.trace.calls if c.module == "sparse"]
    assert call.outputs[0].stats.max is not None  # its stored values' statistics
