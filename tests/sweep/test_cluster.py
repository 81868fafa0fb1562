"""The driver on a real multi-node Ray cluster (ray.cluster_utils.Cluster): a head and 2 boxes x 2 fake GPUs.

One cluster for the whole module (a cluster start costs seconds). The node-removal test runs last: it takes a box away.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pd_dflash.errors import InputError  # noqa: E402
from pd_dflash.schema import Status, parse_row  # noqa: E402
from pd_dflash.spec import expand  # noqa: E402
from pd_dflash.sweep.cluster import run_sweep  # noqa: E402
from pd_dflash.sweep.driver import RunOptions  # noqa: E402
from pd_dflash.sweep.store import Mode, current_rows  # noqa: E402
from tests.sweep.helpers import FAULT, REPO, make_spec, recorded, stored_rows  # noqa: E402

pytestmark = pytest.mark.ray

MiB = 2**20
FAST_HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 2,
}
BOX = {
    "num_cpus": 1,
    "num_gpus": 2,
    "object_store_memory": 100 * MiB,
    "resources": {"accelerator_type:RTX-PRO-6000": 1},
}


@pytest.fixture(scope="module")
def cluster():
    # Workers import the test engines from the driver's working directory (Ray adds it to their sys.path).
    mp = pytest.MonkeyPatch()
    mp.chdir(REPO)
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 100 * MiB,
            "_system_config": FAST_HEALTH,
        },
    )
    boxes = [c.add_node(**BOX) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c, boxes
    ray.shutdown()
    c.shutdown()
    mp.undo()


def options(out, **over):
    base = {
        "out_dir": str(out),
        "progress": False,
        "poll_s": 0.2,
        "refresh_s": 0.5,
        "cell_timeout_s": 30.0,
        "plots": False,
    }
    base.update(over)
    return RunOptions(**base)


def actors_by_class() -> Counter:
    table = ray._private.state.state.actor_table(None)
    return Counter(a["ActorClassName"].rsplit(".", 1)[-1] for a in table.values())


def assert_complete(spec, out):
    rows = stored_rows(out)
    for i, row in enumerate(rows):
        parse_row(row.to_json_dict(), where=f"row {i}")
    ids = [r.cell_id for r in current_rows(rows)]
    assert sorted(ids) == sorted(c.cell_id for c in expand(spec))
    return rows


def test_cells_spread_over_both_boxes_and_every_row_is_valid(cluster, tmp_path):
    _, boxes = cluster
    spec = make_spec(env={"PD_DFLASH_TEST_RECORD": str(tmp_path / "ran.txt")})
    outcome = run_sweep(spec, options(tmp_path / "out"))
    assert outcome.exit_code == 0, outcome
    rows = assert_complete(spec, tmp_path / "out")
    assert len(rows) == 12 and all(r.status == Status.OK for r in rows)
    assert {r.runner["node_id"] for r in rows} == {b.node_id for b in boxes}
    assert all(r.runner["gpu_ids"] and r.runner["pid"] and "device_note" in r.runner for r in rows)
    assert all(r.environment["spec_env"] and r.engine["synthetic"] for r in rows)
    # The spec's env reached the engine: it recorded each cell exactly once.
    assert sorted(recorded(tmp_path / "ran.txt")) == sorted(c.cell_id for c in expand(spec))
    # 4 runners over 2 models: each runner loads once.
    assert outcome.loads <= 4 + 2 - 1
    assert (tmp_path / "out" / "result_matrix.json").exists()


@pytest.fixture(scope="module")
def faulty(cluster, tmp_path_factory):
    """One sweep where a cell kills its runner once, one hangs once, one raises once; the rest succeed."""
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "state").mkdir()
    behaviors = {"B1/c1/r0": "exit_once", "B1/c2/r0": "hang_once", "OURS/c1/r0": "raise_once"}
    spec = make_spec(
        engine=FAULT,
        models=[
            {
                "id": "m1",
                "engine_options": {"seconds": 0.2, "behaviors": behaviors, "state_dir": str(tmp / "state")},
            }
        ],
        env={"PD_DFLASH_TEST_RECORD": str(tmp / "ran.txt")},
    )
    outcome = run_sweep(spec, options(tmp / "out", cell_timeout_s=4.0))
    return spec, tmp, outcome


def cell_of(spec, baseline, concurrency):
    return next(c for c in expand(spec) if c.baseline == baseline and c.concurrency == concurrency)


def test_a_runner_killed_mid_cell_is_recovered(faulty):
    spec, tmp, _outcome = faulty
    rows = {r.cell_id: r for r in stored_rows(tmp / "out")}
    cell = cell_of(spec, "B1", 1)
    assert rows[cell.cell_id].status == Status.OK and rows[cell.cell_id].attempt == 2
    assert recorded(tmp / "ran.txt").count(cell.cell_id) == 2


def test_a_hung_cell_times_out_and_the_sweep_completes(faulty):
    spec, tmp, outcome = faulty
    rows = assert_complete(spec, tmp / "out")
    assert len(rows) == 6
    hung = next(r for r in rows if r.cell_id == cell_of(spec, "B1", 2).cell_id)
    assert hung.status == Status.TIMEOUT and "cell-timeout" in hung.reason
    assert (tmp / "out" / "errors" / f"{hung.cell_id}.txt").exists()
    assert outcome.exit_code == 1  # the sweep finished, with failures to retry


def test_an_engine_exception_gives_an_error_row_with_its_traceback(faulty):
    spec, tmp, _outcome = faulty
    cell = cell_of(spec, "OURS", 1)
    row = next(r for r in stored_rows(tmp / "out") if r.cell_id == cell.cell_id)
    assert row.status == Status.ERROR and "injected failure" in row.reason
    text = (tmp / "out" / "errors" / f"{cell.cell_id}.txt").read_text()
    assert "Traceback" in text and "RuntimeError: injected failure" in text
    others = [
        r for r in stored_rows(tmp / "out") if r.cell_id not in {cell.cell_id, cell_of(spec, "B1", 2).cell_id}
    ]
    assert all(r.status == Status.OK for r in others)


def test_retry_errors_reruns_only_error_and_timeout_cells(faulty):
    spec, tmp, _ = faulty
    before = stored_rows(tmp / "out")
    ran_before = len(recorded(tmp / "ran.txt"))
    outcome = run_sweep(spec, options(tmp / "out", mode=Mode.RETRY_ERRORS, cell_timeout_s=4.0))
    assert outcome.exit_code == 0
    after = stored_rows(tmp / "out")
    assert [r.to_json_dict() for r in after[: len(before)]] == [
        r.to_json_dict() for r in before
    ]  # nothing lost
    failed = {cell_of(spec, "B1", 2).cell_id, cell_of(spec, "OURS", 1).cell_id}
    assert sorted(recorded(tmp / "ran.txt")[ran_before:]) == sorted(failed)
    new = after[len(before) :]
    assert {r.cell_id for r in new} == failed and all(r.status == Status.OK and r.attempt == 2 for r in new)
    current = current_rows(after)
    assert len(current) == 6 and all(r.status == Status.OK for r in current)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"hardware": {"accelerator_type": "H100", "cpus_per_runner": 0}}, "no accelerator_type:H100"),
        (
            {"hardware": {"accelerator_type": "RTX-PRO-6000", "gpus_per_cell": 3, "cpus_per_runner": 0}},
            "GPU 2 < 3",
        ),
        (
            {"hardware": {"accelerator_type": "RTX-PRO-6000", "custom_resource": "rtx_pro_6000"}},
            "rtx_pro_6000",
        ),
        (
            {"engine": "tests.sweep.engines:MissingRequirementEngine", "models": [{"id": "m1"}]},
            "modules not importable: pd_dflash_no_such_module",
        ),
        (
            {"engine": "tests.sweep.engines:UnimportableEngine", "models": [{"id": "m1"}]},
            "cannot import tests.sweep.unimportable:Engine: ImportError",
        ),
    ],
    ids=["accelerator-type", "too-few-gpus", "custom-resource", "requires", "unimportable"],
)
def test_preflight_failures_exit_before_any_actor_starts(cluster, tmp_path, over, message):
    spec = make_spec(**over)
    before = actors_by_class()
    with pytest.raises(InputError) as err:
        run_sweep(spec, options(tmp_path / "out"))
    assert message in str(err.value)
    if "engine" not in over:
        assert "The cluster has:" in str(err.value) and "accelerator types RTX-PRO-6000" in str(err.value)
    assert actors_by_class() == before
    assert not (tmp_path / "out" / "rows.jsonl").exists() and not (tmp_path / "out" / "sweep.json").exists()


def test_unwritable_results_directory_exits_before_any_actor_starts(cluster, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    before = actors_by_class()
    with pytest.raises(InputError, match="not writable"):
        run_sweep(make_spec(), options(tmp_path / "file" / "out"))
    assert actors_by_class() == before


def test_a_box_whose_runners_keep_dying_is_taken_out_of_rotation(cluster, tmp_path):
    _, boxes = cluster
    bad = boxes[0].node_id
    spec = make_spec(
        engine=FAULT, models=[{"id": "m1", "engine_options": {"seconds": 0.3, "bad_node": bad}}], repeats=2
    )
    # Threshold 2 (default 3): both runners of the bad box die on their first cells.
    outcome = run_sweep(spec, options(tmp_path / "out", breaker_threshold=2))
    rows = assert_complete(spec, tmp_path / "out")
    assert outcome.exit_code == 0 and all(r.status == Status.OK for r in rows)
    assert all(r.runner["node_id"] == boxes[1].node_id for r in rows)
    assert [o["node_id"] for o in outcome.out_of_rotation] == [bad]
    assert "2 runner failures in a row" in outcome.out_of_rotation[0]["reason"]
    record = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert record["out_of_rotation"][0]["node_id"] == bad


def test_a_collector_killed_mid_sweep_is_restarted_and_loses_no_row(cluster, tmp_path):
    spec = make_spec(
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.4}},
            {"id": "m2", "engine_options": {"seconds": 0.4}},
        ],
        repeats=3,
    )
    out = tmp_path / "out"
    result = {}
    thread = threading.Thread(target=lambda: result.update(outcome=run_sweep(spec, options(out))))
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not (out / "rows.jsonl").exists() or len(stored_rows(out)) < 4):
        time.sleep(0.05)
    table = ray._private.state.state.actor_table(None).values()
    pid = next(a["Pid"] for a in table if a["ActorClassName"].endswith("Collector") and a["State"] == "ALIVE")
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert result["outcome"].exit_code == 0
    rows = assert_complete(spec, out)
    assert len(rows) == len(expand(spec)) == 36 and all(r.status == Status.OK for r in rows)
    record = json.loads((out / "sweep.json").read_text())
    assert len(record["runs"]) == 1 and record["runs"][0]["collector_restarts"] >= 1


def test_removing_a_box_mid_sweep_loses_no_cell_and_duplicates_none(cluster, tmp_path):
    c, boxes = cluster
    spec = make_spec(
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.4}},
            {"id": "m2", "engine_options": {"seconds": 0.4}},
        ],
        concurrency=[1, 2, 4],
        repeats=2,
        env={"PD_DFLASH_TEST_RECORD": str(tmp_path / "ran.txt")},
    )
    out = tmp_path / "out"
    result = {}
    thread = threading.Thread(target=lambda: result.update(outcome=run_sweep(spec, options(out))))
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(recorded(tmp_path / "ran.txt")) < 6:
        time.sleep(0.1)
    assert len(recorded(tmp_path / "ran.txt")) >= 6, "sweep did not start"
    c.remove_node(boxes[1], allow_graceful=False)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the sweep waited forever after losing a box"
    outcome = result["outcome"]
    rows = assert_complete(spec, out)
    assert len(rows) == len(expand(spec)) == 36  # every cell exactly once
    assert all(r.status == Status.OK for r in rows)
    assert [o["node_id"] for o in outcome.out_of_rotation] == [boxes[1].node_id]
    record = json.loads((out / "sweep.json").read_text())
    assert record["out_of_rotation"][0]["node_id"] == boxes[1].node_id
    # Cells the lost box had started were measured again, on the box that is left.
    interrupted = [cid for cid, n in Counter(recorded(tmp_path / "ran.txt")).items() if n > 1]
    assert interrupted
    assert all(
        next(r for r in rows if r.cell_id == cid).runner["node_id"] == boxes[0].node_id for cid in interrupted
    )
