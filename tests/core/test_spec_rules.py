"""The spec's rules that decide what is measured (pd_dflash/spec.py): what each cell carries, which fields
change a cell id or the fingerprint, and every refusal's exact words."""

from __future__ import annotations

import pytest

from pd_dflash.baselines import BLOCK_INDEPENDENT, OFFLOADED, SPECULATIVE
from pd_dflash.errors import InputError
from pd_dflash.spec import Hardware, Workload, cell_count, expand, iter_cells, load_spec, parse_spec


def data(**over):
    d = {
        "name": "rules",
        "engine": "reference",
        "models": [
            {"id": "a", "preset": "micro", "draft": "da"},
            {"id": "b", "preset": "micro", "draft": "db"},
        ],
        "baselines": ["B0", "B1", "OURS"],
        "block_sizes": [16, 8],
        "concurrency": [1, 2],
        "repeats": 2,
    }
    d.update(over)
    return d


def refused(message: str, **over):
    with pytest.raises(InputError) as err:
        parse_spec(data(**over), source="s.yaml")
    assert message in str(err.value) and str(err.value).startswith("s.yaml: ")


def test_cells_come_in_a_fixed_order_with_what_each_measures():
    spec = parse_spec(data(workload={"max_new_tokens": "auto"}))
    cells = expand(spec)
    assert len(cells) == cell_count(spec) == 2 * (1 * 2 * 2 + 2 * 2 * 2 * 2)
    first = cells[0]
    assert (first.model, first.baseline, first.block_size, first.concurrency, first.repeat) == (
        "a",
        "B0",
        8,
        1,
        0,
    )
    assert [c.repeat for c in cells[:2]] == [0, 1] and cells[2].concurrency == 2
    b0 = [c for c in cells if c.baseline == "B0"]
    assert all(c.draft == "" and c.block_size == 8 and c.block_sizes_covered == (8, 16) for c in b0)
    assert all(c.max_new_tokens == 64 for c in b0)  # auto: max(4 * largest B, 32)
    b1 = [c for c in cells if c.baseline == "B1" and c.model == "b"]
    assert [(c.block_size, c.block_sizes_covered, c.max_new_tokens) for c in b1[::4]] == [
        (16, (16,), 64),
        (8, (8,), 32),
    ]
    assert all(c.draft == "db" for c in b1)
    for c in cells:
        assert c.offloaded == (c.baseline in OFFLOADED)
        assert c.memory_ratio == (0.85 if c.offloaded else 0.98)
        assert c.speculative == (c.baseline in SPECULATIVE)
    assert len({c.cell_id for c in cells}) == len(cells) and all(len(c.cell_id) == 16 for c in cells)
    assert list(iter_cells(spec)) == cells


def test_a_fixed_output_budget_and_the_resident_ratio():
    spec = parse_spec(
        data(baselines=["B3", "B1"], workload={"max_new_tokens": 20}, memory={"resident_memory_ratio": 0.5})
    )
    cells = expand(spec)
    assert {c.max_new_tokens for c in cells} == {20}
    b3 = [c for c in cells if c.baseline == "B3"]
    assert all(not c.offloaded and c.memory_ratio == 0.5 for c in b3)
    assert Workload().resolve_max_new_tokens(4) == 32 and Workload().resolve_max_new_tokens(9) == 36


@pytest.mark.parametrize(
    "change",
    [
        {"engine": "moe_infinity"},
        {"models": [{"id": "a", "preset": "micro", "draft": "da", "engine_options": {"x": 1}}, {"id": "b", "preset": "micro", "draft": "db"}]},
        {"workload": {"seed": 7}},
        {"workload": {"prompt_tokens": 16}},
        {"slo": {"ttft_ms": 100.0}},
        {"hardware": {"device": "cpu"}},
        {"hardware": {"accelerator_type": "H100"}},
        {"env": {"X": "1"}},
        {"memory": {"expert_cache_fraction": 0.5}},
        {"workload": {"chat_date": "2026-01-31"}},
    ],
)  # fmt: skip
def test_a_measured_field_changes_every_cell_id_and_the_fingerprint(change):
    base = parse_spec(data())
    changed = parse_spec(data(**change))
    assert base.fingerprint() != changed.fingerprint()
    before = {(c.model, c.baseline, c.block_size, c.concurrency, c.repeat): c.cell_id for c in expand(base)}
    after = {(c.model, c.baseline, c.block_size, c.concurrency, c.repeat): c.cell_id for c in expand(changed)}
    if "models" in change:  # only model a's options changed: only model a's cells
        assert all((before[k] != after[k]) == (k[0] == "a") for k in before)
    else:
        assert all(before[k] != after[k] for k in before)


@pytest.mark.parametrize(
    "change",
    [
        {"name": "other"},
        {"gates": {"min_coverage": 0.1}},
        {"local": {"fake_gpus": 4}},
        {"max_cells": 1000},
        {"hardware": {"cpus_per_runner": 4.0}},
        {"hardware": {"custom_resource": "rtx"}},
    ],
)
def test_what_does_not_change_a_measurement_keeps_the_cell_ids(change):
    base, changed = parse_spec(data()), parse_spec(data(**change))
    assert len(base.fingerprint()) == 16 and int(base.fingerprint(), 16) >= 0
    assert [c.cell_id for c in expand(base)] == [c.cell_id for c in expand(changed)]
    if "hardware" not in change:
        assert base.fingerprint() == changed.fingerprint()


def test_a_cell_does_not_depend_on_the_other_axes_values():
    small = parse_spec(data(concurrency=[2]))
    big = parse_spec(data(concurrency=[1, 2, 4]))
    key = lambda c: (c.model, c.baseline, c.block_size, c.repeat)  # noqa: E731
    ids = {key(c): c.cell_id for c in expand(big) if c.concurrency == 2}
    assert all(ids[key(c)] == c.cell_id for c in expand(small))


def test_every_refusal_names_its_field_and_reason():
    refused("duplicate value 8 in block_sizes", block_sizes=[8, 8])
    refused("duplicate value 'B1' in baselines", baselines=["B1", "B1"])
    refused("duplicate value 2 in concurrency", concurrency=[2, 2])
    refused("duplicate value 'a' in models[].id", models=[{"id": "a"}, {"id": "a"}])
    refused("must be letters, digits, '.', '_' or '-' (it names the sweep and its job)", name="my sweep")
    refused(
        "file: needs a path, e.g. file:prompts.jsonl (JSONL with a `prompt` field per line)",
        workload={"prompts": "file: "},
    )
    refused(
        "0.95 would not offload any expert (upstream refuses ratios >= 0.9); use a value below 0.9 for "
        "offloaded configurations",
        memory={"device_memory_ratio": 0.95},
    )
    refused("unknown metric 'vibes'; use names from REQUIRED_METRICS", gates={"allow_unmeasured": ["vibes"]})
    refused(
        "duplicate value 'ttft_seconds' in allow_unmeasured", gates={"allow_unmeasured": ["ttft_seconds"] * 2}
    )
    refused(
        "the spec expands to 40 cells, more than max_cells = 39; shrink an axis (repeats, concurrency, "
        "block_sizes, baselines, models) or raise max_cells",
        max_cells=39,
    )
    assert cell_count(parse_spec(data(max_cells=40))) == 40
    with pytest.raises(InputError) as err:
        parse_spec(["not", "a", "mapping"], source="s.yaml")
    assert str(err.value) == "s.yaml: a sweep spec must be a mapping, got list"


def test_device_ratio_just_below_the_limit_offloads():
    assert parse_spec(data(memory={"device_memory_ratio": 0.8999})).memory.device_memory_ratio == 0.8999
    refused("0.9 would not offload any expert", memory={"device_memory_ratio": 0.9})


def test_hardware_names_and_capability():
    assert Hardware().expected_gpu_name == "RTX PRO 6000"
    assert Hardware(gpu_name="H200").expected_gpu_name == "H200"
    assert Hardware(accelerator_type=None).expected_gpu_name is None
    assert parse_spec(data(hardware={"compute_capability": [9, 0]})).hardware.compute_capability == (9, 0)


def test_spec_files_that_cannot_be_specs(tmp_path):
    with pytest.raises(InputError) as err:
        load_spec(tmp_path / "none.yaml")
    assert str(err.value) == f"{tmp_path / 'none.yaml'}: cannot read spec: No such file or directory"
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(InputError) as err:
        load_spec(big)
    assert str(err.value) == f"{big}: larger than 1048576 bytes: not a sweep spec"
    exact = tmp_path / "exact.yaml"
    exact.write_bytes(b"name: x\n" + b"#" * ((1 << 20) - 8))
    with pytest.raises(InputError, match="models") as err:  # read in full (1 MiB is allowed), then validated
        load_spec(exact)
    assert str(err.value).startswith(f"{exact}: ")  # a validation error names the file


def test_block_independent_baselines_are_measured_once_per_concurrency_and_repeat():
    spec = parse_spec(data(baselines=sorted(BLOCK_INDEPENDENT)))
    assert cell_count(spec) == 2 * len(BLOCK_INDEPENDENT) * 2 * 2


def test_a_spec_that_never_ends_is_refused_after_one_byte_past_the_limit(tmp_path):
    """A spec path whose writer keeps it open (a pipe, e.g. a shell's ``<(...)``): load_spec reads one byte
    past the limit and refuses, without waiting for an end of file that does not come."""
    import os
    import threading

    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    released = threading.Event()
    waited_out: list[bool] = []

    def feed():
        with open(fifo, "wb") as fh:
            fh.write(b"#" * ((1 << 20) + 1))
            fh.flush()
            waited_out.append(not released.wait(20))  # the pipe stays open until the reader is done

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    with pytest.raises(InputError) as err:
        load_spec(fifo)
    released.set()
    writer.join(30)
    assert str(err.value) == f"{fifo}: larger than 1048576 bytes: not a sweep spec"
    assert waited_out == [False]  # refused while the writer still held the pipe open


def test_a_yaml_date_in_an_engine_option_hashes_as_its_iso_text(tmp_path):
    """An unquoted YAML date is a date object in the spec; the fingerprint hashes the spec's JSON form, where
    it is its ISO text: the same measurement as the quoted text, and not another date."""
    import datetime

    import yaml

    def spec_with(since, name):
        path = tmp_path / name
        models = [{"id": "a", "preset": "micro", "draft": "da", "engine_options": {"since": since}}]
        path.write_text(yaml.safe_dump(data(models=models)))
        return load_spec(path)

    dated = spec_with(datetime.date(2024, 1, 2), "dated.yaml")
    assert dated.models[0].engine_options["since"] == datetime.date(2024, 1, 2)
    quoted = spec_with("2024-01-02", "quoted.yaml")
    assert quoted.models[0].engine_options["since"] == "2024-01-02"
    assert dated.fingerprint() == quoted.fingerprint()
    assert [c.cell_id for c in expand(dated)] == [c.cell_id for c in expand(quoted)]
    assert spec_with(datetime.date(2024, 1, 3), "other.yaml").fingerprint() != dated.fingerprint()


def test_an_engine_loads_a_link_ablation_model_with_the_first_rate():
    """``single_valued``: a list-valued ``emulated_h2d_gbps`` (an ablation axis) becomes its first value, the
    other options kept; a model without that axis is itself."""
    from pd_dflash.spec import ModelSpec

    model = ModelSpec(id="a", engine_options={"emulated_h2d_gbps": [4.0, 16.0, 64.0], "cache": 2})
    loaded = model.single_valued()
    assert loaded.engine_options == {"emulated_h2d_gbps": 4.0, "cache": 2}
    assert model.engine_options["emulated_h2d_gbps"] == [4.0, 16.0, 64.0]  # the spec itself is unchanged
    assert ModelSpec(id="b", engine_options={"emulated_h2d_gbps": [8.0]}).single_valued().engine_options == {
        "emulated_h2d_gbps": 8.0
    }
    plain = ModelSpec(id="c", engine_options={"emulated_h2d_gbps": 2.5})
    assert plain.single_valued() is plain


def test_a_cell_id_is_the_hash_of_its_fields_and_of_what_the_spec_measures():
    """Recomputed from the definition (spec.py: ``sha256(canonical({"cell": fields, **measured}))[:16]``),
    with every measured part written out: a renamed key or a part hashed in another form changes every
    stored cell id (resume would no longer recognise a single row)."""
    import datetime
    import hashlib
    import json

    model = {
        "id": "a",
        "preset": "micro",
        "draft": "da",
        "engine_options": {"since": datetime.date(2024, 1, 2)},
    }
    spec = parse_spec(
        data(
            models=[model],
            memory={"expert_cache_fraction": 0.5},
            slo={"ttft_ms": 200.0},
            env={"X": "1"},
            workload={"max_new_tokens": 40, "temperature": 1},
            hardware={"cpus_per_runner": 2, "custom_resource": "gpu_box", "compute_capability": [9, 0]},
        )
    )
    measured = {
        "engine": "reference",
        "model": {
            "id": "a",
            "path": None,
            "draft": "da",
            "offload_dir": None,
            "preset": "micro",
            "engine_options": {"since": "2024-01-02"},
        },
        "workload": {
            "requests": 64,
            "warmup_rounds": 5,
            "prompts": "synthetic",
            "prompt_tokens": 32,
            "temperature": 1.0,
            "seed": 1408,
        },
        "expert_cache_fraction": 0.5,
        "slo": {"ttft_ms": 200.0, "tpot_ms": None},
        "hardware": {
            "accelerator_type": "RTX-PRO-6000",
            "gpu_name": None,
            "compute_capability": [9, 0],
            "gpus_per_cell": 1,
            "device": "auto",
        },
        "env": {"X": "1"},
    }

    def expected_id(fields):
        text = json.dumps({"cell": fields, **measured}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    cells = expand(spec)
    ours = next(c for c in cells if c.baseline == "OURS" and c.block_size == 8 and c.concurrency == 2)
    fields = {
        "model": "a",
        "draft": "da",
        "baseline": "OURS",
        "block_size": 8,
        "concurrency": 2,
        "repeat": ours.repeat,
        "block_sizes_covered": [8],
        "max_new_tokens": 40,
        "offloaded": True,
        "memory_ratio": 0.85,
    }
    assert ours.cell_id == expected_id(fields)
    for cell in cells:
        # the sample seed is not hashed: repeat and workload.seed, which the id holds, determine it
        fields = {
            **cell.model_dump(mode="json", exclude={"cell_id", "ablation", "sample_seed"}),
            "block_sizes_covered": list(cell.block_sizes_covered),
        }
        assert cell.cell_id == expected_id(fields), cell


def test_a_spec_given_as_data_is_named_spec_in_its_errors():
    with pytest.raises(InputError) as err:
        parse_spec(["not", "a", "mapping"])
    assert str(err.value) == "<spec>: a sweep spec must be a mapping, got list"
    with pytest.raises(InputError) as err:
        parse_spec(data(repeats=0))
    assert str(err.value).startswith("<spec>: ") and "repeats" in str(err.value)
