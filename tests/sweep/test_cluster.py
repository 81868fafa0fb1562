"""The driver on a real multi-node Ray cluster (ray.cluster_utils.Cluster): a head and 2 boxes x 2 fake GPUs.

One cluster for the whole module (a cluster start costs seconds). The node-removal test runs last: it takes a box away.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from collections import Counter

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pd_dflash.errors import InputError  # noqa: E402
from pd_dflash.rows import read_rows  # noqa: E402
from pd_dflash.schema import Row, Status, parse_row  # noqa: E402
from pd_dflash.spec import expand  # noqa: E402
from pd_dflash.sweep.cluster import run_sweep  # noqa: E402
from pd_dflash.sweep.manifest import env_summary  # noqa: E402
from pd_dflash.sweep.options import RunOptions  # noqa: E402
from pd_dflash.sweep.resume import ARCHIVE_DIR, Mode, current_rows  # noqa: E402
from pd_dflash.sweep.store import SweepStore  # noqa: E402
from tests.sweep.engines import synthetic_result  # noqa: E402
from tests.sweep.helpers import (  # noqa: E402
    FAULT,
    REPO,
    make_spec,
    recorded,
    resize_filesystem,
    small_filesystem,
    stored_rows,
)
from tests.sweep.load_fault_engine import ENTRY_POINT as LOAD_FAULT  # noqa: E402
from tests.sweep.probe_engine import ENTRY_POINT as PROBE  # noqa: E402

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
        "insecure": True,  # the test cluster runs with RAY_AUTH_MODE=disabled (tests/conftest.py)
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


def test_cells_spread_over_both_boxes_and_every_row_is_valid(cluster, tmp_path, capsys):
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
    # The test cluster has no token auth: --insecure let the run start, with a warning.
    assert "WARNING: the cluster runs without token authentication" in capsys.readouterr().out


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


def test_runner_deaths_requeues_and_timeouts_are_appended_to_events_jsonl(faulty):
    spec, tmp, _ = faulty
    lines = (tmp / "out" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert all(e["at"] and e["event"] for e in events)
    killed, hung = cell_of(spec, "B1", 1).cell_id, cell_of(spec, "B1", 2).cell_id
    died = [e for e in events if e["event"] == "runner_died"]
    assert [e["cell_id"] for e in died] == [killed] and "runner died" in died[0]["cause"]
    again = [e for e in events if e["event"] == "requeued" and e["cell_id"] == killed]
    assert again[0]["attempt"] == 2 and again[0]["was_running"] is True
    timeouts = [e for e in events if e["event"] == "timeout"]
    assert [e["cell_id"] for e in timeouts] == [hung] and timeouts[0]["cell_timeout_s"] == 4.0


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


def test_a_cluster_without_token_auth_is_refused_unless_insecure(cluster, tmp_path):
    before = actors_by_class()
    with pytest.raises(InputError, match="without token authentication") as err:
        run_sweep(make_spec(), options(tmp_path / "out", insecure=False))
    assert "RAY_AUTH_MODE=disabled" in str(err.value) and "--insecure" in str(err.value)
    assert actors_by_class() == before and not (tmp_path / "out").exists()


SECRET = "hf_TESTtoken0123456789abcdef"


def test_env_values_reach_the_engine_but_no_file_of_the_results_directory(cluster, tmp_path):
    env = {"HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "1"}
    engine_options = {"seconds": 0.1, "echo_env": ["HF_TOKEN"], "behaviors": {"B1/c1/r0": "raise"}}
    spec = make_spec(engine=FAULT, models=[{"id": "m1", "engine_options": engine_options}], env=env)
    out = tmp_path / "out"
    outcome = run_sweep(spec, options(out))
    assert outcome.exit_code == 1  # the one cell that raised
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"rows.jsonl", "sweep.json", "result_matrix.json"} <= {p.name for p in files}
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
    rows = stored_rows(out)
    assert all(r.environment["spec_env"] == env_summary(env) for r in rows)
    assert env_summary(env)["names"] == ["HF_HUB_OFFLINE", "HF_TOKEN"]
    # The engine did see the value (it echoed it), and what it echoed was replaced before anything was written.
    ok = next(r for r in rows if r.status == Status.OK)
    assert (
        ok.engine["env_seen"] == {"HF_TOKEN": "<env HF_TOKEN>"} and "HF_TOKEN=<env HF_TOKEN>" in ok.warnings
    )
    failed = next(r for r in rows if r.status == Status.ERROR)
    assert "<env HF_TOKEN>" in failed.reason
    assert "<env HF_TOKEN>" in (out / "errors" / f"{failed.cell_id}.txt").read_text()
    assert json.loads((out / "sweep.json").read_text())["spec"]["env"] == env_summary(env)
    # Created 0640 / 0750 at most: nothing for other users.
    for path in [out, *out.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o027 == 0, (path, oct(mode))


def test_a_custom_engine_is_imported_by_runners_and_preflight_only(cluster, tmp_path):
    spec = make_spec(engine=PROBE, baselines=["B0", "B2", "B3"], models=[{"id": "m1"}])
    sys.modules.pop("tests.sweep.probe_engine", None)  # loading the spec validated its name there
    outcome = run_sweep(spec, options(tmp_path / "out"))
    assert "tests.sweep.probe_engine" not in sys.modules  # the driver planned and scheduled without it
    assert outcome.exit_code == 0
    rows = {r.baseline: r for r in stored_rows(tmp_path / "out")}
    # Its traits reached the driver from preflight: B2 refused with its reason, B3 on a load of its own.
    assert rows["B2"].status == Status.REFUSED and "no token-deficit scheduler" in rows["B2"].reason
    assert rows["B0"].runner["load_group"] == "shared" and rows["B3"].runner["load_group"] == "resident"


def test_a_full_disk_stops_the_sweep_and_resume_repairs_what_it_left(cluster, tmp_path, capsys):
    spec = make_spec(
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.3}},
            {"id": "m2", "engine_options": {"seconds": 0.3}},
        ],
        repeats=4,
        env={"PD_DFLASH_TEST_RECORD": str(tmp_path / "ran.txt")},
    )
    total = len(expand(spec))
    with small_filesystem(tmp_path / "disk", "64k") as disk:
        out = disk / "out"
        outcome = run_sweep(spec, options(out))
        assert outcome.exit_code == 1 and outcome.outcome == "storage_failed", outcome
        assert "No space left on device" in outcome.stopped and "rows.jsonl" in outcome.stopped
        assert "cannot store results" in capsys.readouterr().out
        kept, torn = read_rows(out / "rows.jsonl", tolerate_torn_tail=True)
        assert 0 < len(kept) < total
        # No measuring into the void: at most what the 4 runners had in hand when the failure came back.
        assert len(recorded(tmp_path / "ran.txt")) <= len(kept) + 12

        resize_filesystem(disk, "16m")  # space comes back
        outcome = run_sweep(spec, options(out))
        said = capsys.readouterr().out
        assert outcome.exit_code == 0, said
        rows = stored_rows(out)  # strict: no torn line left anywhere
        assert sorted(r.cell_id for r in rows) == sorted(c.cell_id for c in expand(spec))
        assert [r.cell_id for r in rows[: len(kept)]] == [r.cell_id for r in kept]  # nothing stored was lost
        if torn is not None:  # a partial line was left: resume moved it aside and said so
            assert "repaired a torn last line" in said and (out / "rows.jsonl.torn").exists()


def test_a_results_directory_too_full_to_open_is_refused_before_any_cell_runs(cluster, tmp_path):
    with small_filesystem(tmp_path / "disk", "8k") as disk:  # room for the probe and the lock, not sweep.json
        before = actors_by_class()["RunnerActor"] + actors_by_class()["Runner"]
        with pytest.raises(InputError, match="No space left on device") as err:
            run_sweep(make_spec(), options(disk / "out"))
        assert "cannot prepare the results directory" in str(err.value)
        assert actors_by_class()["RunnerActor"] + actors_by_class()["Runner"] == before
        assert not (disk / "out" / "rows.jsonl").exists()


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


def collector_pid() -> int:
    table = ray._private.state.state.actor_table(None).values()
    return next(
        a["Pid"] for a in table if a["ActorClassName"].endswith("Collector") and a["State"] == "ALIVE"
    )


def test_a_collector_killed_during_a_restart_sweep_does_not_archive_again(cluster, tmp_path):
    spec = make_spec(
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.4}},
            {"id": "m2", "engine_options": {"seconds": 0.4}},
        ],
        repeats=3,
    )
    out = tmp_path / "out"
    # A previous run left one row: --restart must archive it once, and only once.
    previous = SweepStore(out, spec, Mode.RESUME)
    previous.open()
    previous.add(Row.from_result(expand(spec)[0], synthetic_result(expand(spec)[0], 4, 0.1), sweep=spec.name))
    previous.close()
    result = {}
    run = lambda: result.update(outcome=run_sweep(spec, options(out, mode=Mode.RESTART)))  # noqa: E731
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        (out / ARCHIVE_DIR).exists() and (out / "rows.jsonl").exists() and len(stored_rows(out)) >= 4
    ):
        time.sleep(0.05)
    assert len(stored_rows(out)) >= 4, "the restarted sweep stored no rows in time"
    os.kill(collector_pid(), signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert result["outcome"].exit_code == 0
    # One archive: the previous run's row. The restarted collector reopened in resume mode, so the rows this run
    # stored before the kill stayed where they were.
    (archive,) = (out / ARCHIVE_DIR).iterdir()
    assert [r.cell_id for r in stored_rows(archive)] == [expand(spec)[0].cell_id]
    rows = assert_complete(spec, out)
    assert len(rows) == len(expand(spec)) == 36 and all(r.status == Status.OK for r in rows)
    record = json.loads((out / "sweep.json").read_text())
    assert [r["mode"] for r in record["runs"]] == ["restart"] and record["runs"][0]["collector_restarts"] >= 1


def test_model_loads_that_keep_failing_are_given_up_with_error_rows(cluster, tmp_path):
    spec = make_spec(
        engine=LOAD_FAULT,
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.1, "fail_load": True}},
            {"id": "m2", "engine_options": {"seconds": 0.1}},
        ],
    )
    out = tmp_path / "out"
    outcome = run_sweep(spec, options(out, max_attempts=2, breaker_threshold=10))
    assert outcome.exit_code == 1  # the sweep finished; m1's cells are failures to retry
    rows = {r.cell_id: r for r in assert_complete(spec, out)}
    for cell in expand(spec):
        row = rows[cell.cell_id]
        if cell.model == "m2":
            assert row.status == Status.OK and row.attempt == 1
            continue
        # Every cell of the model that never loaded: an ERROR row naming the tries and the cause, no metrics.
        assert row.status == Status.ERROR, row
        assert row.reason.startswith("model could not be loaded (2 tries): model load failed: ")
        assert "injected load failure for m1" in row.reason
        assert row.present_metrics() == []
        assert (out / "errors" / f"{cell.cell_id}.txt").exists()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    # Both runners may be loading m1 when the second failure gives up: a load still in flight then fails too
    # and is counted (3/2) after the cells were already stored as ERROR; only the first give-up drops cells.
    failed = [e for e in events if e["event"] == "load_failed"]
    assert {e["model"] for e in failed} == {"m1"} and [e["failures"] for e in failed][:2] == [1, 2]
    given_up = [e for e in events if e["event"] == "model_given_up"]
    assert given_up[0]["model"] == "m1" and given_up[0]["cells"] == 6
    assert all(e["cells"] == 0 for e in given_up[1:])
    # The matrix says so too: m1's groups hold ERROR rows with the reason, m2's are measured.
    matrix = json.loads((out / "result_matrix.json").read_text())
    for c in (1, 2):
        for baseline in ("B0", "B1", "OURS"):
            bad, good = matrix[f"m1|B8|c{c}"][baseline], matrix[f"m2|B8|c{c}"][baseline]
            assert bad["status"] == "ERROR" and "model could not be loaded" in bad["reason"]
            assert bad["n_repeats"] == 0 and "output_tokens_per_second" not in bad
            assert "status" not in good and good["n_repeats"] == 1  # OK: upstream writes no status
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["groups"]["m1|B8|c1"]["failed"]["B1"][0].startswith("repeat 0: ERROR (model could not")


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
