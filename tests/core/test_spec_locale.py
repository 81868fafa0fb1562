"""Paths inside a spec in any locale (issue 29 item 6): under ``LC_ALL=C PYTHONUTF8=0`` a non-ASCII string in the
spec (a model or drafter path, a ``file:`` prompt, an env value) is refused when the spec is loaded (exit 2),
naming the field and the filesystem encoding, never a UnicodeEncodeError; under a UTF-8 locale it works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.core.helpers import base_spec

C_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0"}
UTF8_LOCALE = {"LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
NAME = "/tmp/pd-dflash-m\u00f6del"


def child(args, env_over, cwd=None):
    env = {**os.environ, **env_over, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("LANG", None)
    return subprocess.run([sys.executable, *args], capture_output=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def c_encoding():
    out = child(["-c", "import sys; print(sys.getfilesystemencoding())"], C_LOCALE).stdout.decode().strip()
    if out.lower().replace("-", "") in ("utf8",):
        pytest.skip("this Python keeps UTF-8 under LC_ALL=C: no non-UTF-8 locale to test")
    return out


def spec_with(tmp_path, field: str):
    data = base_spec(baselines=["B0", "B1"], block_sizes=[8], concurrency=[1])
    model = data["models"][0]
    if field in ("path", "draft", "offload_dir"):
        model[field] = NAME
    elif field == "prompts":
        data["workload"] = {"prompts": f"file:{NAME}.jsonl"}
    elif field == "env":
        data["env"] = {"SECRET_DIR": NAME}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data, ensure_ascii=True))
    return path


WHERE = {
    "path": "models.0.path",
    "draft": "models.0.draft",
    "offload_dir": "models.0.offload_dir",
    "prompts": "workload.prompts",
    "env": "env.SECRET_DIR",
}


@pytest.mark.parametrize("field", sorted(WHERE))
def test_plan_refuses_a_non_ascii_spec_string_under_the_c_locale_naming_field_and_encoding(
    tmp_path, field, c_encoding
):
    out = child(["-m", "pd_dflash", "plan", str(spec_with(tmp_path, field))], C_LOCALE)
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 2, err
    assert f"{WHERE[field]}: " in err and f"filesystem encoding ({c_encoding})" in err
    assert "Traceback" not in err and "UnicodeEncodeError" not in err
    if field == "env":
        assert "pd-dflash-m" not in err  # an env value is never printed


@pytest.mark.parametrize("command", ["run", "report"])
def test_run_and_report_refuse_it_too_before_ray(tmp_path, command, c_encoding):
    spec = spec_with(tmp_path, "path")
    if command == "run":
        args = ["run", str(spec), "--out", str(tmp_path / "out"), "--no-progress"]
    else:
        (tmp_path / "rows.jsonl").write_text("")
        args = ["report", str(tmp_path / "rows.jsonl"), "--spec", str(spec), "--out", str(tmp_path / "r")]
    out = child(["-m", "pd_dflash", *args], C_LOCALE)
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 2 and "models.0.path: " in err and c_encoding in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_under_a_utf8_locale_the_same_paths_work(tmp_path):
    prompts = (
        tmp_path / "pr\u00f6mpts.txt"
    )  # token ids, one prompt a line (the micro preset has no tokenizer)
    prompts.write_text("1 2 3 4\n5 6 7 8\n", encoding="utf-8")
    data = base_spec(baselines=["B0", "B1"], block_sizes=[8], concurrency=[1])
    data["models"][0]["path"] = NAME
    data["workload"] = {"prompts": str(prompts)}
    data["env"] = {"SOME_DIR": NAME}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(data, ensure_ascii=True))
    out = child(["-m", "pd_dflash", "plan", str(spec)], UTF8_LOCALE)
    assert out.returncode == 0, out.stderr.decode()
