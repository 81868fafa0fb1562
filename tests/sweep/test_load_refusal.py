"""A model load that fails on a deterministic input error is not retried (issue 22, defect 6): a model path
that is not there or not a checkpoint, CUDA asked for on a box without it, a load the engine refuses. Its
cells are REFUSED at once with the named reason, instead of ``max_attempts`` loads and ERROR rows."""

from __future__ import annotations

import json
import pickle

import pytest

ray = pytest.importorskip("ray")
from ray.exceptions import RayTaskError  # noqa: E402

from pd_dflash.engine.interface import Refused  # noqa: E402
from pd_dflash.errors import InputError  # noqa: E402
from pd_dflash.schema import Status  # noqa: E402
from pd_dflash.spec import expand  # noqa: E402
from pd_dflash.sweep.cluster import run_sweep  # noqa: E402
from pd_dflash.sweep.options import RunOptions  # noqa: E402
from pd_dflash.sweep.runner import input_refusal  # noqa: E402
from tests.sweep.helpers import REPO, make_spec, stored_rows  # noqa: E402
from tests.sweep.load_fault_engine import ENTRY_POINT as LOAD_FAULT  # noqa: E402

#: These tests start local clusters and runners that import torch (a minute or two on a loaded machine): the
#: generous per-test limit of cluster tests, not the unit tests' 120 s (tests/conftest.py), which [bad-paths]
#: exceeded on a busy 2-core VM (three torch imports in series: preflight, then one runner per bad model).
pytestmark = pytest.mark.ray


def wrapped(exc: BaseException) -> RayTaskError:
    """The error ``ray.get`` raises for a task or actor method that raised ``exc`` (after a round trip)."""
    return pickle.loads(pickle.dumps(RayTaskError("Runner.load", "Traceback ...", exc)))


def test_input_errors_and_refusals_are_deterministic_and_other_failures_are_not():
    missing = InputError("/data/qwen does not exist on this box", where="models[].path")
    assert input_refusal(wrapped(missing)) == (
        Status.REFUSED,
        "models[].path: /data/qwen does not exist on this box",
    )
    assert input_refusal(missing) == (Status.REFUSED, str(missing))
    refused = Refused(Status.UNAVAILABLE_CAPACITY, "the host store needs 61 GB, 32 GB available")
    assert input_refusal(wrapped(refused)) == (Status.UNAVAILABLE_CAPACITY, refused.reason)
    assert input_refusal(wrapped(RuntimeError("CUDA error: an illegal memory access"))) is None
    assert input_refusal(wrapped(OSError(5, "Input/output error"))) is None
    assert input_refusal(RuntimeError("x")) is None


def test_a_load_that_fails_on_bad_input_refuses_its_cells_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the workers import the test engine from the working directory
    if ray.is_initialized():
        ray.shutdown()
    spec = make_spec(
        engine=LOAD_FAULT,
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.05, "bad_input": "input"}},
            {"id": "m2", "engine_options": {"seconds": 0.05, "bad_input": "refused"}},
            {"id": "m3", "engine_options": {"seconds": 0.05}},
        ],
    )
    out = tmp_path / "out"
    opts = RunOptions(out_dir=str(out), progress=False, poll_s=0.2, plots=False, max_attempts=3)
    outcome = run_sweep(spec, opts)
    rows = {r.cell_id: r for r in stored_rows(out)}
    assert sorted(rows) == sorted(c.cell_id for c in expand(spec))
    for cell in expand(spec):
        row = rows[cell.cell_id]
        if cell.model == "m3":
            assert row.status == Status.OK
        elif cell.model == "m1":
            assert row.status == Status.REFUSED and row.attempt == 1, row
            assert "not retried" in row.reason and "models[].path: /nowhere/m1 does not exist" in row.reason
        else:
            assert row.status == Status.UNAVAILABLE_CAPACITY and "2 TB of host memory" in row.reason
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "load_failed"]  # never counted as a failure to retry
    refused = [e for e in events if e["event"] == "model_refused"]
    assert {e["model"] for e in refused} == {"m1", "m2"} and sum(e["cells"] for e in refused) == 12
    assert outcome.loads <= 4  # one try per bad model (two runners), not max_attempts
    assert outcome.exit_code == 1  # m1's refused load is the user's to fix (issue 29): the run says so
    assert all(rows[c.cell_id].refusal == "input" for c in expand(spec) if c.model == "m1")


@pytest.mark.parametrize(
    ("models", "device"),
    [
        (  # two bad paths in one sweep: each model's load is refused on its own
            [
                ({"id": "org/absent", "path": "{tmp}/nowhere"}, "{tmp}/nowhere does not exist"),
                ({"id": "org/file", "path": "{tmp}/file.txt"}, "{tmp}/file.txt is not a directory"),
            ],
            "cpu",
        ),
        ([({"id": "micro", "preset": "micro"}, "CUDA is not available")], "cuda"),
    ],
    ids=["bad-paths", "no-cuda"],
)
def test_the_reference_engine_refuses_a_bad_path_or_device_without_retrying(
    tmp_path, monkeypatch, models, device
):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this box has CUDA")
    monkeypatch.chdir(REPO)
    if ray.is_initialized():
        ray.shutdown()
    (tmp_path / "file.txt").write_text("not a checkpoint")
    named = {m["id"]: reason.format(tmp=tmp_path) for m, reason in models}
    spec = make_spec(
        engine="reference",
        models=[{k: v.format(tmp=tmp_path) for k, v in m.items()} for m, _ in models],
        baselines=["B0"],
        hardware={"accelerator_type": None, "cpus_per_runner": 1, "device": device},
        local={"fake_gpus": 1, "num_cpus": 2, "object_store_mb": 100},
    )
    out = tmp_path / "out"
    opts = RunOptions(out_dir=str(out), progress=False, poll_s=0.2, plots=False, max_attempts=3)
    run_sweep(spec, opts)
    rows = stored_rows(out)
    assert len(rows) == len(expand(spec)) == 2 * len(models)
    assert all(r.status == Status.REFUSED and named[r.model] in r.reason for r in rows), rows
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("model_refused") == len(models)
    assert not [e for e in events if e["event"] == "load_failed"]


def test_a_box_that_lacks_an_input_another_box_has_is_taken_out_and_the_cells_run(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    monkeypatch.chdir(REPO)
    if ray.is_initialized():
        ray.shutdown()
    box = {"num_cpus": 1, "num_gpus": 1, "object_store_memory": 100 * 2**20}
    box["resources"] = {"accelerator_type:RTX-PRO-6000": 1}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * 2**20})
    try:
        good, bad = c.add_node(**box), c.add_node(**box)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        options = {"seconds": 0.3, "bad_input_node": bad.node_id}  # 12 cells: 3.6 s of work on one box
        spec = make_spec(engine=LOAD_FAULT, models=[{"id": "m1", "engine_options": options}], repeats=2)
        out = tmp_path / "out"
        opts = RunOptions(out_dir=str(out), progress=False, poll_s=0.2, plots=False, insecure=True)
        run_sweep(spec, opts)
        rows = stored_rows(out)
        assert len(rows) == len(expand(spec)) and all(r.status == Status.OK for r in rows)
        assert {r.runner["node_id"] for r in rows} == {good.node_id}
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        (out_event,) = [e for e in events if e["event"] == "box_out_of_rotation"]
        assert out_event["node_id"] == bad.node_id and "cannot load m1 here" in out_event["reason"]
        assert not [e for e in events if e["event"] == "model_refused"]
    finally:
        ray.shutdown()
        c.shutdown()
