"""A prompt + max_new_tokens + B beyond the model's positions (issue 29, item 2): refused at plan where the plan
can count the prompts (a checkpoint's tokenizer.json, torch-free), and REFUSED by the engine on the prompts it
made where it cannot (never a row measured past the positions)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pd_dflash.cli import main
from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.schema import Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import WORKLOAD, make_engine, make_spec

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def qwen(tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(materialise("tiny-real-qwen3-moe"), target)
    return target


def set_positions(directory: Path, n: int) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = n
    (directory / "config.json").write_text(json.dumps(config))


def write_spec(tmp_path: Path, model_id: str, directory: Path, prompts: str, **workload) -> Path:
    data = {
        "name": "t",
        "models": [{"id": model_id, "path": str(directory), "engine_options": {"drafter": "early_exit"}}],
        "baselines": ["B0", "B1"],
        "block_sizes": [8],
        "concurrency": [1],
        "workload": {"prompts": prompts, "requests": 2, "max_new_tokens": 16, **workload},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def plan(spec: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["plan", str(spec)])
    out = capsys.readouterr()
    return code, out.err + out.out


def test_a_text_prompt_beyond_a_checkpoints_positions_is_refused_at_plan(qwen, tmp_path, capsys):
    set_positions(qwen, 256)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 300}) + "\n")
    code, err = plan(write_spec(tmp_path, "org/tiny-base", qwen, f"file:{prompts}"), capsys)
    assert code == 2, err
    assert "models.0" in err and "max_position_embeddings" in err and str(qwen / "config.json") in err
    assert "256" in err and "at least 300 tokens" in err  # the prompt's own tokens (a character tokenizer)
    prompts.write_text(json.dumps({"prompt": "x" * 200}) + "\n")  # 200 + 16 + 8 fits in 256
    assert plan(write_spec(tmp_path, "org/tiny-base", qwen, f"file:{prompts}"), capsys)[0] == 0


def test_humaneval_through_an_instruct_targets_tokenizer_is_a_lower_bound(qwen, tmp_path, capsys):
    set_positions(qwen, 512)  # the longest HumanEval problem is ~1,400 characters: tokens of a char tokenizer
    code, err = plan(write_spec(tmp_path, "org/tiny-Instruct", qwen, "humaneval"), capsys)
    assert code == 2 and "at least" in err and "512" in err and "Traceback" not in err, err


def test_the_plan_check_imports_neither_torch_nor_ray(qwen, tmp_path):
    set_positions(qwen, 512)
    spec = write_spec(tmp_path, "org/tiny-Instruct", qwen, "humaneval")
    code = f"""
import sys
from pd_dflash.cli import main
assert main(["plan", {str(spec)!r}]) == 2
bad = [m for m in ("torch", "ray", "transformers") if m in sys.modules]
assert not bad, bad
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_engine_refuses_a_cell_whose_prompts_run_past_the_positions(micro):
    # Not through plan (which refuses it): the engine's own check on the prompts it made, before any forward.
    spec = make_spec(baselines=("B1",), concurrency=(1,), workload={**WORKLOAD, "prompt_tokens": 2040})
    engine = make_engine(spec)
    with pytest.raises(Refused) as refused:
        engine.run_cell(expand(spec)[0])
    assert refused.value.status == Status.REFUSED
    reason = refused.value.reason
    assert "2,040 tokens" in reason and "max_position_embeddings" in reason and "2,048" in reason
    assert "B = 8" in reason and "workload.max_new_tokens (12)" in reason


def test_the_cpu_engine_checks_its_kv_cache_against_host_memory_before_allocating(micro):
    # The CPU engine's "device" is the host: a KV cache the host cannot hold is REFUSED (never an allocation
    # error, an ERROR row with a --retry-errors hint that could only fail again).
    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.reference.engine import ReferenceEngine

    class Host(ReferenceEngine):
        host = None  # unknown at load (nothing checked), then set per cell

        def host_available_bytes(self):
            return self.host

    spec = make_spec(baselines=("B3",), concurrency=(4,))
    engine = Host(EngineContext.for_model(spec, device="cpu"))
    engine.host = 10**6  # less than the 512 MiB headroom alone
    with pytest.raises(Refused) as refused:
        engine.run_cell(expand(spec)[0])
    reason = refused.value.reason
    assert refused.value.status == Status.REFUSED
    assert "of host memory but only 1,000,000 B" in reason and "KV cache" in reason
    assert "workload.max_new_tokens" in reason
    engine.host = None
    assert engine.run_cell(expand(spec)[0]).status == Status.OK
    engine.close()
