"""Ray is told how much host memory a runner needs (the engine's figure): in the runner's resource request and
in how many runners a box can host. Pure functions, no cluster."""

from __future__ import annotations

from pd_dflash.engine import registry
from pd_dflash.spec import Hardware, ModelSpec
from pd_dflash.sweep.preflight import box_capacity, runner_options

GIB = 2**30
HW = Hardware(accelerator_type=None, cpus_per_runner=1)


def test_the_runner_requests_the_engines_host_memory_figure():
    assert runner_options(HW, 20 * GIB)["memory"] == 20 * GIB
    assert "memory" not in runner_options(HW)  # unknown: nothing reserved


def test_a_box_hosts_no_more_runners_than_its_memory_holds():
    resources = {"GPU": 8.0, "CPU": 64.0, "memory": 100.0 * GIB}
    assert box_capacity(resources, HW) == (8, [])
    assert box_capacity(resources, HW, 30 * GIB) == (3, [])
    capacity, lacks = box_capacity(resources, HW, 120 * GIB)
    assert capacity == 0 and "memory" in lacks[0] and "per runner" in lacks[0]


def test_the_reference_engine_gives_its_figure_without_torch(tmp_path):
    assert registry.traits("reference").host_memory.startswith(
        "pd_dflash.engine.reference.checkpoints.host_memory:"
    )
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        '{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16", '
        '"hidden_size": 4, "num_hidden_layers": 0, "num_experts": 2, "moe_intermediate_size": 2, '
        '"tie_word_embeddings": true}'
    )
    # A safetensors file written by hand: 8-byte header length, JSON header, the data (a model of no layer).
    header = (
        b'{"model.embed_tokens.weight":{"dtype":"BF16","shape":[125,4],"data_offsets":[0,1000]},'
        b'"model.norm.weight":{"dtype":"BF16","shape":[4],"data_offsets":[1000,1008]}}'
    )
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 1008)
    size = (ckpt / "model.safetensors").stat().st_size
    assert registry.host_memory_bytes("reference", ModelSpec(id=str(ckpt))) == size
    assert registry.host_memory_bytes("moe_infinity", ModelSpec(id=str(ckpt))) is None


def test_the_figure_imports_neither_torch_nor_an_engine(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from pd_dflash.engine import registry; from pd_dflash.spec import ModelSpec; "
        f"registry.host_memory_bytes('reference', ModelSpec(id={str(tmp_path)!r})); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
