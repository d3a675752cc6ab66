"""A forward that calls a ``torch.compile``'d function: ``diagnose`` runs it eagerly (``set_stance("force_eager")``
for its passes), so its hooks and modes see the function's ops, and dynamo never traces ampdoctor's own code.
Before, each pass made dynamo trace the hidden-overflow mode inside the function, recompiling up to its limit
(seconds per diagnosis), and the ops inside stayed out of sight of the op zoom.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

dynamo = pytest.importorskip("torch._dynamo")
pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: 2.6+")


@torch.compile(backend="eager")  # dynamo only: no C++ compiler needed
def amplify(x: torch.Tensor) -> torch.Tensor:
    return x * 5000.0 * torch.sigmoid(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return amplify(self.lin(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.Linear(8, 8), Block(), nn.Linear(8, 1))


def stance() -> str:
    """torch's own record of the current stance (a new object each time it is set)."""
    return str(dynamo.eval_frame._stance.stance)


def frames() -> int:
    return int(dynamo.utils.counters["frames"]["total"])


def test_ops_inside_a_compiled_function_are_seen_and_dynamo_traces_nothing_during_the_passes() -> None:
    m = model()
    x = torch.rand(4, 8) + 1.0
    m(x)  # compiled once, outside the diagnosis
    before = frames()
    report = ampdoctor.diagnose(m, x, dtype=torch.float16)
    assert frames() == before  # no frame traced: nothing of ampdoctor's compiled, no recompile
    origin = report.forward_origin
    assert report.verdict == "overflow"
    assert origin is not None and origin.module == "2"  # 5000 x 5000: the second block overflows
    assert origin.op is not None and origin.op.op == "aten::mul.Tensor" and origin.op.scalar_args == (5000.0,)
    assert origin.op.location is not None and origin.op.location.function == "amplify"
    assert stance() == "default"  # put back


def test_the_stance_is_put_back_when_the_model_raises() -> None:
    class Raises(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("shape")

    with pytest.raises(ampdoctor.AmpDoctorError):
        ampdoctor.diagnose(Raises(), torch.rand(2))
    assert stance() == "default"


def test_diagnoses_that_leave_in_any_order_put_the_stance_back() -> None:
    """Two diagnoses in two threads share the process's one stance: the first sets it, the last one out puts
    back what was there, whichever leaves first (before: the second restored the first's "force_eager")."""
    from ampdoctor.capture.model import _set_compiled_calls_aside

    first = _set_compiled_calls_aside(nn.Linear(1, 1))
    second = _set_compiled_calls_aside(nn.Linear(1, 1))
    assert stance() == "force_eager"
    first()
    assert stance() == "force_eager"  # the second is still running
    second()
    second()  # idempotent
    assert stance() == "default"


def test_a_users_own_stance_is_kept() -> None:
    with torch.compiler.set_stance("eager_on_recompile"):
        ampdoctor.diagnose(model(), torch.rand(4, 8))
        assert stance() == "eager_on_recompile"
    assert stance() == "default"
