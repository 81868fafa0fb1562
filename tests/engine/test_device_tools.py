"""NVML, NVTX and the probe degrade cleanly on a machine without a GPU; the CUDA paths run only with CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from pd_dflash.engine import nvml  # noqa: E402
from pd_dflash.engine.nvtx_ranges import nvtx_range  # noqa: E402
from pd_dflash.engine.probe import measure_h2d_bytes_per_second  # noqa: E402
from pd_dflash.upstream import NVTX_RANGES  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_nvtx_ranges_accept_upstream_names_only():
    for name in NVTX_RANGES:
        with nvtx_range(name):
            pass
    with pytest.raises(ValueError, match="unknown NVTX range"), nvtx_range("my_phase"):
        pass


class _RangeRecorder:
    """Stands in for ``torch.cuda.nvtx``: records the ranges pushed, in order."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def push_range(self, message: str) -> None:
        self.names.append(message)

    def pop_range(self) -> None:
        pass


@pytest.mark.parametrize(
    ("speculative", "cached", "expected"),
    [(True, [False], []), (True, [False, True], ["dflash_draft"]), (False, [True], [])],
    ids=["prefill-only", "one-request-drafts", "autoregressive"],
)
def test_dflash_draft_is_emitted_only_when_a_request_is_drafted_for(
    monkeypatch, speculative, cached, expected
):
    """A speculative proposal of prompts only drafts nothing, so it opens no ``dflash_draft`` range (upstream's
    parser would count it as draft time); an AR proposal never does."""
    from types import SimpleNamespace

    from pd_dflash.engine import nvtx_ranges
    from pd_dflash.engine.reference.decoding.loop import _Serving

    recorder = _RangeRecorder()
    monkeypatch.setattr(nvtx_ranges, "_nvtx", recorder)
    requests = [SimpleNamespace(rid=i, cached=c) for i, c in enumerate(cached)]
    decoding = SimpleNamespace(
        speculative=speculative, propose=lambda fresh: [SimpleNamespace(request=r) for r in fresh]
    )
    hooks = SimpleNamespace(plan=lambda blocks: False)
    loop = _Serving(None, [], len(requests), decoding, hooks, None, clock=lambda: 0.0)
    loop.active = list(requests)
    windows = loop.propose()
    assert recorder.names == expected
    assert [w[0] for w in windows] == (["draft"] if expected else [])
    assert sorted(loop.pending) == [r.rid for r in requests]


@no_cuda
def test_nvml_degrades_to_a_note_without_a_driver():
    assert nvml.device_identity() is None and nvml.telemetry() is None
    check = nvml.validate_device("RTX PRO 6000", (12, 0))
    assert check.ok and "not validated" in check.note


@no_cuda
def test_probe_cli_says_there_is_no_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "probe", "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["device"] is None and data["cuda_available"] is False
    assert "h2d" not in data and data["host_copy"]["bytes_per_second"] > 0 and "no CUDA" in data["note"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_measures_pinned_h2d_on_cuda():
    bw = measure_h2d_bytes_per_second(nbytes=64 * 2**20, copies=5)
    assert bw is not None and bw > 1e9
    identity = nvml.device_identity()
    assert identity is not None and identity["uuid"]
