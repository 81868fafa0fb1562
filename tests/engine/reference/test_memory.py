"""Memory checked before it is allocated, on the CPU with injected figures: the host arena and the device
(non-expert weights, the expert cache + KV cache). A figure that does not fit is REFUSED with the figures."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.interface import EngineContext, Refused
from pd_dflash.engine.reference.engine import ReferenceEngine
from pd_dflash.engine.reference.offload.memory import DEVICE_HEADROOM_BYTES, host_available_bytes
from pd_dflash.engine.reference.offload.store import HostArena, HostExpertStore
from pd_dflash.schema import Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_spec


def tensors(layers=2, experts=4):
    torch.manual_seed(0)
    return {layer: [torch.randn(experts, 6, 3), torch.randn(experts, 3, 5)] for layer in range(layers)}


def test_the_arena_hands_out_aligned_views_of_one_allocation():
    specs = [((4, 6, 3), torch.float32), ((4, 3, 5), torch.bfloat16), ((4,), torch.float8_e4m3fn)]
    assert HostArena.size_of(specs) == 512 + 256 + 256  # 288 B, 120 B and 4 B, each rounded up to 256 B
    arena = HostArena(HostArena.size_of(specs))
    views = [arena.take(shape, dt) for shape, dt in specs]
    assert [tuple(v.shape) for v in views] == [s for s, _ in specs]
    assert [v.dtype for v in views] == [dt for _, dt in specs]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert [v.data_ptr() - views[0].data_ptr() for v in views] == [0, 512, 768]
    with pytest.raises(ValueError, match="full"):
        arena.take((1,), torch.uint8)


def test_the_store_lives_in_one_arena_of_the_exact_size():
    store = HostExpertStore(tensors(), storage="fp8")
    # per layer: fp8 [4,6,3] 72 B → 256, [4,3,5] 60 B → 256, two fp32 scales [4] 16 B → 256 each
    assert store.arena.nbytes == store.arena.used == 2 * 4 * 256
    base = store.arena.buffer.untyped_storage().data_ptr()
    for layer in store.layer_ids:
        for t in store.parts[layer] + [s for s in store.scales[layer] if s is not None]:
            assert t.untyped_storage().data_ptr() == base


@pytest.mark.parametrize(("available", "fits"), [(1295, False), (1296, True), (None, True)])
def test_the_host_store_is_refused_when_its_peak_does_not_fit(available, fits):
    # fp32 store of fp32 sources, per layer: arena 512 + 256 = 768 B, source 288 + 240 = 528 B released after
    # it. Peak excess: max(768, 768 + 768 − 528) = 1008 B, plus the largest temporary (288 B): 1296 B.
    if fits:
        assert HostExpertStore(tensors(), host_available_bytes=available).arena.nbytes == 1536
        return
    with pytest.raises(Refused) as refused:
        HostExpertStore(tensors(), host_available_bytes=available)
    assert refused.value.status == Status.REFUSED
    assert "1,296 B" in refused.value.reason and "1,295 B" in refused.value.reason
    assert "1,536 B of experts in one arena" in refused.value.reason


def test_host_memory_is_read_from_the_system_here():
    assert host_available_bytes() > 0  # Linux: MemAvailable (and the cgroup's headroom)


def injected(host=None, device_at_load=None):
    """A ReferenceEngine whose available figures are injected (``device`` may be changed after the load)."""

    class Injected(ReferenceEngine):
        device_bytes = device_at_load

        def host_available_bytes(self):
            return host

        def device_available_bytes(self):
            return self.device_bytes

    spec = make_spec(baselines=("B0", "B3"), concurrency=(1,))
    return spec, Injected(EngineContext.for_model(spec, device="cpu"))


def test_a_host_store_that_does_not_fit_refuses_every_cell_with_the_figures(micro):
    spec, engine = injected(host=1000)
    assert "load_refused" in engine.describe()
    for cell in expand(spec):
        with pytest.raises(Refused) as refused:
            engine.run_cell(cell)
        assert refused.value.status == Status.REFUSED
        assert "host memory" in refused.value.reason and "1,000 B are available" in refused.value.reason
    engine.close()


def test_non_expert_weights_that_do_not_fit_the_device_refuse_every_cell(micro):
    spec, engine = injected(device_at_load=4096)
    with pytest.raises(Refused, match=r"non-expert weights needs [\d,]+ B of device memory but only 4,096 B"):
        engine.run_cell(expand(spec)[0])
    engine.close()


def test_a_cell_whose_cache_and_kv_do_not_fit_the_device_is_refused_with_the_figures(micro):
    spec, engine = injected()
    b0, b3 = (next(c for c in expand(spec) if c.baseline == b) for b in ("B0", "B3"))
    # B3 at c = 1 holds every micro expert: 16 × 24,576 B. KV upper bound: K and V × 2 layers × 2 KV heads ×
    # 16 dims × 4 B = 512 B per token, for 12 prompt + 12 new + 8 (B) tokens.
    needed = 16 * 24_576 + 512 * 32 + DEVICE_HEADROOM_BYTES
    engine.device_bytes = needed - 1
    with pytest.raises(Refused) as refused:
        engine.run_cell(b3)
    assert f"{needed:,} B of device memory but only {needed - 1:,} B" in refused.value.reason
    assert "B3 holds every expert on the device" in refused.value.reason
    engine.device_bytes = needed
    assert engine.run_cell(b3).status == Status.OK
    # B0's cache (25 % of the experts: 4 slots) fits in the same figure.
    assert engine.run_cell(b0).status == Status.OK
    engine.close()


def test_a_runner_needs_its_experts_as_stored_and_its_other_weights_in_host_memory(tmp_path):
    """The streaming loader's peak (CPU device): the experts as the checkpoint stores them, plus the non-expert
    weights in the compute dtype."""
    import shutil

    from pd_dflash.engine.reference.checkpoints.host_memory import runner_host_memory_bytes
    from pd_dflash.engine.reference.checkpoints.tiny import materialise
    from pd_dflash.spec import ModelSpec
    from tests.engine.reference.helpers import tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("qwen3_moe").save_pretrained(str(ckpt))  # fp32 weights
    files = sum(len(f.read_bytes()) for f in ckpt.glob("*.safetensors"))
    experts = (
        2 * 8 * 3 * 32 * 16 * 4
    )  # layers × experts × (gate, up, down) × hidden × moe_intermediate × fp32
    assert runner_host_memory_bytes(ModelSpec(id=str(ckpt))) == files
    # bf16 compute: the experts stay as stored (fp32), the other weights halve.
    bf16 = ModelSpec(id=str(ckpt), engine_options={"dtype": "bf16"})
    assert runner_host_memory_bytes(bf16) == experts + (files - experts) // 2
    assert runner_host_memory_bytes(ModelSpec(id="micro", preset="micro")) is None  # a preset: a few MB
    assert runner_host_memory_bytes(ModelSpec(id=str(tmp_path / "nowhere"))) is None  # not on this box
    # MXFP4 experts count as stored: 8 experts × 2 layers × 6,912 B.
    gpt_oss = tmp_path / "gpt-oss"
    shutil.copytree(materialise("tiny-real-gpt-oss"), gpt_oss)
    files = sum(len(f.read_bytes()) for f in gpt_oss.glob("*.safetensors"))
    assert runner_host_memory_bytes(ModelSpec(id="openai/gpt-oss-20b", path=str(gpt_oss))) == files
