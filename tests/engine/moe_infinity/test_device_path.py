"""The adapter's device path: prompts everywhere; on CUDA, device validation, the H2D probe and telemetry.

The CUDA tests run the adapter against the fake package on a real device (the fake computes on the CPU, the
adapter's device checks, probe and NVML telemetry are real); they skip cleanly without CUDA.
"""

from __future__ import annotations

import pytest

from pd_dflash.engine.moe_infinity.prompts import SYNTHETIC_TEXTS, UPSTREAM_PROMPT, build_prompts
from pd_dflash.errors import InputError
from pd_dflash.schema import Status
from pd_dflash.spec import Workload, sample_seed
from tests.engine.moe_infinity.fakes import SMALL, cell, import_fake, make_spec, run


def _tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def test_synthetic_prompts_are_deterministic_windows(tokenizer_dir):
    tok = _tokenizer(tokenizer_dir)
    workload = Workload(prompt_tokens=12, seed=1408)
    prompts = build_prompts(tok, workload, 6)
    assert prompts == build_prompts(tok, workload, 6)
    assert all(len(p) == 12 for p in prompts) and len({tuple(p) for p in prompts}) == 6
    assert build_prompts(tok, workload, 6, salt=1) != prompts  # warm-up prompts differ from timed ones
    assert build_prompts(tok, Workload(prompt_tokens=12, seed=7), 6) != prompts
    first = tok(UPSTREAM_PROMPT, add_special_tokens=False)["input_ids"]
    assert 0 not in first  # every word of the synthetic texts is in the test vocabulary (no [UNK])


def test_prompt_file(tmp_path, tokenizer_dir):
    tok = _tokenizer(tokenizer_dir)
    path = tmp_path / "prompts.txt"
    path.write_text(
        "Explain what the acceptance length of a speculative decoder measures\n\nWrite a short function\n"
    )
    prompts = build_prompts(tok, Workload(prompts=str(path)), 3)
    assert [len(p) for p in prompts] == [10, 4, 10]
    path.write_text("\n\n")
    with pytest.raises(InputError, match="no non-empty prompt"):
        build_prompts(tok, Workload(prompts=str(path)), 1)
    with pytest.raises(InputError, match="cannot read prompt file"):
        build_prompts(tok, Workload(prompts=str(tmp_path / "missing.txt")), 1)


def _cuda_context(spec):
    from pd_dflash.engine.interface import EngineContext

    return EngineContext.for_model(spec, device="cuda:0")


def _this_device():
    import torch

    return torch.cuda.get_device_name(0), list(torch.cuda.get_device_capability(0))


@pytest.mark.gpu
def test_cuda_device_is_validated_against_the_spec(monkeypatch, tmp_path, tokenizer_dir):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one visible CUDA device")
    from pd_dflash.engine.moe_infinity.engine import MoEInfinityEngine

    import_fake(monkeypatch)
    wrong = make_spec(
        tmp_path, tokenizer_dir, hardware={"compute_capability": [1, 0], "gpu_name": "No Such GPU"}
    )
    engine = MoEInfinityEngine(_cuda_context(wrong))
    result = run(engine, cell(wrong, "B0", concurrency=1))
    assert result.status is Status.REFUSED
    assert "device rejected" in result.reason and "compute capability" in result.reason


@pytest.mark.gpu
def test_cuda_rows_carry_the_probe_and_telemetry(monkeypatch, tmp_path, tokenizer_dir):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one visible CUDA device")
    from pd_dflash.engine.moe_infinity.engine import MoEInfinityEngine

    import_fake(monkeypatch)
    name, capability = _this_device()
    spec = make_spec(
        tmp_path,
        tokenizer_dir,
        hardware={"gpu_name": name, "compute_capability": capability, "device": "cuda"},
        engine_options={"expert_byte_budget": "h2d_window"},
        **SMALL,
    )
    engine = MoEInfinityEngine(_cuda_context(spec))
    probe = engine.describe()["h2d_probe_bytes_per_second"]
    assert probe > 1e9  # any PCIe/NVLink host link moves more than 1 GB/s
    result = run(engine, cell(spec, "OURS", 8, 1))
    assert result.status is Status.OK, result.warnings
    assert result.cost_terms.measured_h2d_bytes_per_second == probe
    assert result.cost_terms.h2d_bandwidth_source == "probe" and result.cost_terms.h2d_link == "real"
    budgets = result.engine["configuration"]["verify_budgets"]
    assert budgets["verify_expert_byte_budget"] == int(probe * 0.02)  # h2d_window: probe x 20 ms
    telemetry = result.telemetry
    assert (
        telemetry["start"]["clocks_mhz"]["sm"] is not None
        and telemetry["end"]["time"] >= telemetry["start"]["time"]
    )
    assert result.engine["device_identity"]["uuid"].startswith("GPU-")


def test_each_repeat_sample_draws_other_prompts(tmp_path, tokenizer_dir):
    """``seed`` is the cell's repeat sample (``Cell.sample_seed``): the spec's seed keeps the prompts above, another
    seed draws other windows and another order of a prompt file."""
    tok = _tokenizer(tokenizer_dir)
    workload = Workload(prompt_tokens=12, seed=1408)
    assert build_prompts(tok, workload, 6, seed=1408) == build_prompts(tok, workload, 6)
    assert build_prompts(tok, workload, 6, seed=99) != build_prompts(tok, workload, 6)
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(SYNTHETIC_TEXTS) + "\n")
    file_workload = Workload(prompts=str(path), seed=1408)
    first = build_prompts(tok, file_workload, 8)
    other = build_prompts(tok, file_workload, 8, seed=sample_seed(1408, 1))
    assert sorted(other) == sorted(first) and other != first  # the same prompts, in another order
