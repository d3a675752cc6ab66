"""Reliability, round 2 (issue 19 items 5, 7, 8, 9, 11): two threads on one model, sparse gradients, a failed
refinement pass, a model that prints under the CLI, deeply nested models."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.cli.main import main

# -- item 9: the model's prints never reach stdout under the CLI -------------------------------------------------


def test_json_on_stdout_stays_json_when_the_model_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "printer.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            print("importing the model")

            class Loud(nn.Module):
                def __init__(self):
                    super().__init__()
                    print("building")
                    self.fc = nn.Linear(4, 2)

                def forward(self, x):
                    print("forward", tuple(x.shape))
                    return self.fc(x)

            def build():
                return Loud()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    torch.save({f"fc.{k}": v for k, v in nn.Linear(4, 2).state_dict().items()}, tmp_path / "loud.pt")
    code = main(["diagnose", "loud.pt", "--model", "printer:build", "--input-shape", "3x4", "--format", "json", "-q"])
    out, err = capsys.readouterr()
    assert code == 0
    report = json.loads(out)  # the whole of stdout is the report
    assert report["verdict"] == "healthy"
    assert "forward (3, 4)" in err and "building" in err and "importing the model" in err
    assert "forward (3, 4)" not in out and "building" not in out
