"""REFUSED rows carry their kind (issue 29, item 2): a refusal of the user's own making ("input": a spec value,
a checkpoint or file it names, a load the engine refused) makes the run exit non-zero and say so; a documented one
(a baseline the engine declares it does not implement, a library build's missing feature) is not counted."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from pd_dflash.baselines import ORDER  # noqa: E402
from pd_dflash.engine.interface import Refused  # noqa: E402
from pd_dflash.engine.registry import EngineTraits  # noqa: E402
from pd_dflash.errors import InputError  # noqa: E402
from pd_dflash.schema import Row, Status  # noqa: E402
from pd_dflash.spec import Cell, expand  # noqa: E402
from pd_dflash.sweep.cluster import run_sweep  # noqa: E402
from pd_dflash.sweep.options import RunOptions  # noqa: E402
from tests.sweep.engines import FixedDurationEngine  # noqa: E402
from tests.sweep.helpers import REPO, make_spec, stored_rows  # noqa: E402

ENTRY_POINT = "tests.sweep.test_refusal_kinds:RefusingEngine"


class RefusingEngine(FixedDurationEngine):
    """B1 of model ``doc`` refused as documented, B1 of model ``bad`` as the spec's doing (and its B0 at c = 2
    meets a bad input while running); B2 never run."""

    traits = EngineTraits(
        entry_point=ENTRY_POINT,
        options_model="tests.sweep.engines:FixedDurationOptions",
        supported_baselines=frozenset(ORDER) - {"B2"},
        unsupported_reason={"B2": "this engine has no token-deficit scheduler"},
    )

    def run_cell(self, cell: Cell):
        if cell.baseline == "B1" and cell.model == "doc":
            raise Refused(Status.REFUSED, "this build lacks the B1 switch", kind="documented")
        if cell.baseline == "B1" and cell.model == "bad":
            raise Refused(Status.REFUSED, "memory.expert_cache_fraction holds every expert")
        if cell.baseline == "B0" and cell.model == "bad" and cell.concurrency == 2:  # met while running
            raise InputError("prompt 3 encodes to no token", where="workload.prompts")
        return super().run_cell(cell)


def test_the_kind_is_only_for_refused_rows_and_decides_what_counts():
    cell = expand(make_spec())[0]
    assert Row.without_metrics(cell, Status.REFUSED, "x").refusal == "input"  # the default kind
    documented = Row.without_metrics(cell, Status.REFUSED, "x", refusal="documented")
    assert not documented.counted_refusal and documented.to_json_dict()["refusal"] == "documented"
    assert Row.without_metrics(cell, Status.REFUSED, "x").counted_refusal
    old = Row.model_validate({**documented.to_json_dict(), "refusal": None})  # a row from before kinds
    assert old.counted_refusal and "refusal" not in old.to_json_dict()
    assert "refusal" not in Row.without_metrics(cell, Status.ERROR, "boom").to_json_dict()
    with pytest.raises(ValueError, match="kind of a REFUSED row"):
        Row.without_metrics(cell, Status.BLOCKED_UNTIL_2D_SCHEDULER, "x", refusal="documented")
    with pytest.raises(ValueError, match="kind"):
        Refused(Status.REFUSED, "x", kind="mine")
    blocked = Refused(Status.BLOCKED_UNTIL_2D_SCHEDULER, "no 2-D scheduler", kind="documented").result()
    assert blocked.refusal is None  # a blocked row is never counted: it has no kind


def test_a_run_with_refusals_of_the_users_making_exits_non_zero_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the workers import this engine from the working directory
    if ray.is_initialized():
        ray.shutdown()
    spec = make_spec(
        engine=ENTRY_POINT,
        models=[
            {"id": "doc", "engine_options": {"seconds": 0.05}},
            {"id": "bad", "engine_options": {"seconds": 0.05}},
        ],
        baselines=["B0", "B1", "B2"],
    )
    out = tmp_path / "out"
    outcome = run_sweep(spec, RunOptions(out_dir=str(out), progress=False, poll_s=0.2, plots=False))
    rows = {(r.model, r.baseline, r.concurrency): r for r in stored_rows(out)}
    assert len(rows) == len(expand(spec))
    for c in (1, 2):
        assert rows[("doc", "B1", c)].refusal == "documented"
        assert rows[("bad", "B1", c)].refusal == "input" and "every expert" in rows[("bad", "B1", c)].reason
        for model in ("doc", "bad"):  # the engine's declared scope: documented, stored by the driver
            assert (
                rows[(model, "B2", c)].status == Status.REFUSED
                and rows[(model, "B2", c)].refusal == "documented"
            )
    assert (
        rows[("doc", "B0", 1)].status
        == rows[("doc", "B0", 2)].status
        == rows[("bad", "B0", 1)].status
        == Status.OK
    )
    # A deterministic input error met at run time is REFUSED with its reason, never an ERROR to --retry-errors.
    met = rows[("bad", "B0", 2)]
    assert (
        met.status == Status.REFUSED and met.refusal == "input" and "workload.prompts: prompt 3" in met.reason
    )
    matrix = json.loads((out / "result_matrix.json").read_text())  # the report reads rows with a kind
    assert matrix["bad|B8|c1"]["B1"]["status"] == matrix["doc|B8|c1"]["B1"]["status"] == "REFUSED"
    assert outcome.exit_code == 1
    said = capsys.readouterr().out
    assert "writing the result matrices failed" not in said
    assert "3 cells REFUSED for what the spec or its inputs ask" in said


class ReadsNoCacheEngine(FixedDurationEngine):
    """A custom engine that declares it reads none of the engine-specific fields (``registry.ENGINE_FIELDS``)."""

    traits = EngineTraits(
        entry_point="tests.sweep.test_refusal_kinds:ReadsNoCacheEngine",
        options_model="tests.sweep.engines:FixedDurationOptions",
        reads=frozenset(),
    )


def test_a_custom_engines_declared_reads_are_checked_at_preflight(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    if ray.is_initialized():
        ray.shutdown()
    spec = make_spec(
        engine="tests.sweep.test_refusal_kinds:ReadsNoCacheEngine",
        memory={"expert_cache_fraction": [0.25, 0.5]},
    )
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"does not read memory\.expert_cache_fraction") as refused:
        run_sweep(spec, RunOptions(out_dir=str(out), progress=False, poll_s=0.2, plots=False))
    assert refused.value.exit_code == 2
    assert not (out / "rows.jsonl").exists()
