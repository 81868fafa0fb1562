"""Spec values that plan used to accept and a runner choked on (issue 22, defect 4): each is a named spec error
at plan time, exit 2, never a Ray or OS exception text."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pd_dflash.cli import main
from pd_dflash.spec import expand, parse_spec
from pd_dflash.spec_inputs import DEFAULT_CHAT_DATE, RAY_MIN_TASK_MEMORY, local_memory_problem
from tests.core.helpers import spec_data


def plan(tmp_path: Path, capsys, data: dict) -> tuple[int, str]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    code = main(["plan", str(path)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"": "1"}, "env"),
        ({"A=B": "1"}, "env"),
        ({"A\x00B": "1"}, "env"),
        ({"A": "x\x00y"}, "env.A"),
        ({"A": "1", "=": "2"}, "env"),
    ],
)
def test_an_env_entry_the_os_refuses_is_a_spec_error(tmp_path, capsys, env, named):
    code, err = plan(tmp_path, capsys, spec_data(env=env))
    assert code == 2, err
    assert named in err and "Traceback" not in err
    assert "NUL" in err or "'='" in err


@pytest.mark.parametrize(
    "where",
    [
        {"models": [{"id": "micro", "preset": "micro", "path": "/tmp/a\x00b"}]},
        {"name": "t", "workload": {"prompts": "file:/x\x00y"}},
        {"hardware": {"custom_resource": "gpu\x00"}},
    ],
)
def test_a_nul_anywhere_in_the_spec_is_named(tmp_path, capsys, where):
    code, err = plan(tmp_path, capsys, spec_data(**where))
    assert code == 2 and "NUL" in err and "Traceback" not in err, err


@pytest.mark.parametrize("form", ["file:{}", "{}"])
def test_a_prompt_file_that_is_not_there_is_refused_at_plan(tmp_path, capsys, form):
    missing = tmp_path / "nowhere" / "prompts.jsonl"
    code, err = plan(tmp_path, capsys, spec_data(workload={"prompts": form.format(missing)}))
    assert code == 2, err
    assert "workload.prompts" in err and "does not exist" in err and str(missing) in err


def test_a_prompt_source_that_is_a_directory_is_refused_at_plan(tmp_path, capsys):
    code, err = plan(tmp_path, capsys, spec_data(workload={"prompts": f"file:{tmp_path}"}))
    assert code == 2 and "not a regular file" in err, err


def test_a_prompt_file_with_a_bad_line_is_named_at_plan(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"text": 1}\n')
    code, err = plan(tmp_path, capsys, spec_data(workload={"prompts": f"file:{prompts}"}))
    assert code == 2 and f"{prompts}:2" in err and "prompt" in err, err


def test_an_object_store_larger_than_the_machine_is_refused_at_plan(tmp_path, capsys):
    code, err = plan(tmp_path, capsys, spec_data(local={"object_store_mb": 10**9}))  # ~1 PB
    assert code == 2, err
    assert "local.object_store_mb" in err and "does not fit" in err and "ValueError" not in err


def test_the_object_store_check_with_injected_figures():
    gib = 2**30
    assert local_memory_problem(1024, 16 * gib, 8 * gib) is None
    assert "has 1,024 MiB" in local_memory_problem(1024, gib, None)  # no room for Ray's task memory
    assert "has available" in local_memory_problem(4096, 16 * gib, 2 * gib)
    fits = (4096 * 2**20 + RAY_MIN_TASK_MEMORY) // 1
    assert local_memory_problem(4096, fits, fits) is None
    assert local_memory_problem(4096, fits - 1, None) is not None
    assert local_memory_problem(4096, None, None) is None  # not measurable here: nothing refused


def test_an_unset_chat_date_keeps_the_cell_ids_and_a_set_one_changes_them():
    base = parse_spec(spec_data())
    assert base.workload.chat_date is None and DEFAULT_CHAT_DATE == "2025-08-05"
    dated = parse_spec(spec_data(workload={"chat_date": "2026-01-31"}))
    assert dated.fingerprint() != base.fingerprint()
    assert {c.cell_id for c in expand(dated)}.isdisjoint(c.cell_id for c in expand(base))


@pytest.mark.parametrize("date", ["2026-02-30", "yesterday", "2026-1-5", "20260105"])
def test_a_chat_date_must_be_a_real_iso_date(tmp_path, capsys, date):
    code, err = plan(tmp_path, capsys, spec_data(workload={"chat_date": date}))
    assert code == 2 and "workload.chat_date" in err and "YYYY-MM-DD" in err, err


def test_plan_notes_a_model_path_that_is_not_here_and_refuses_one_that_is_a_file(tmp_path, capsys):
    absent = tmp_path / "weights" / "qwen"
    model = {"id": "org/qwen", "path": str(absent), "engine_options": {"drafter": "early_exit"}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data(models=[model])))
    capsys.readouterr()
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"models.0.path {absent} does not exist here" in out
    (tmp_path / "weights").mkdir()
    absent.write_text("not a checkpoint")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "models.0.path" in err and f"{absent} is not a directory" in err


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"hardware": {"cpus_per_runner": 0.00005}}, "hardware.cpus_per_runner"),
        ({"hardware": {"cpus_per_runner": 1e9}}, "hardware.cpus_per_runner"),
        ({"hardware": {"custom_resource": "GPU"}}, "hardware.custom_resource"),
        ({"hardware": {"custom_resource": "memory"}}, "hardware.custom_resource"),
        ({"hardware": {"custom_resource": "node:10.0.0.1"}}, "hardware.custom_resource"),
        ({"hardware": {"custom_resource": "accelerator_type:H100"}}, "hardware.custom_resource"),
        ({"local": {"fake_gpus": 10**6}}, "local.fake_gpus"),
        ({"local": {"num_cpus": 10**9}}, "local.num_cpus"),
    ],
)
def test_resource_figures_ray_would_refuse_are_spec_errors(tmp_path, capsys, over, named):
    code, err = plan(tmp_path, capsys, spec_data(**over))
    assert code == 2 and named in err and "Traceback" not in err, err


def test_resource_figures_ray_accepts_still_plan(tmp_path, capsys):
    for over in (
        {"hardware": {"cpus_per_runner": 0}},
        {"hardware": {"cpus_per_runner": 0.5, "custom_resource": "rtx"}},
    ):
        assert plan(tmp_path, capsys, spec_data(**over))[0] == 0
