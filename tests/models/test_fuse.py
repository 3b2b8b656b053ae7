import torch

from kvabi.models import ContiguousAttention
from tests.models.tiny import make_hf, random_ids


def test_fused_projections_keep_outputs_and_the_state_dict(tmp_path):
    from kvabi.models.hf_loader import load_hf

    for arch in ("llama", "qwen2"):  # qwen2: the q/k/v biases are fused too
        make_hf(arch).save_pretrained(tmp_path / arch)
        model = load_hf(tmp_path / arch, "fp32", progress=False).build()
        ids = random_ids(12)
        before = model(ids, torch.arange(12), ContiguousAttention.for_config(model.config))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.fuse_projections().fuse_projections()  # idempotent
        after = model(ids, torch.arange(12), ContiguousAttention.for_config(model.config))
        assert torch.allclose(before, after, atol=1e-5)
        fused = model.state_dict()
        assert fused.keys() == state.keys()
        assert all(torch.equal(fused[k], state[k]) for k in state)
        qkv = model.layers[0].self_attn.qkv.weight
        k_weight = model.layers[0].self_attn.k_proj.weight  # a view into the fused weight
        assert k_weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()


def test_fused_cpu_kernels_keep_the_model_outputs():
    from kvabi.native.cpu_kernels import cpu_kernels
    from tests.engine.tiny import tiny_loaded

    kernels = cpu_kernels()
    assert kernels is not None
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_loaded(dtype=dtype).model.use_kernels(None)  # loaded with kernels on
        ids = random_ids(12)
        with torch.inference_mode():
            before = model(ids, torch.arange(12), ContiguousAttention.for_config(model.config))
            model.use_kernels(kernels)
            after = model(ids, torch.arange(12), ContiguousAttention.for_config(model.config))
            model.use_kernels(None)
        scale = before.abs().max().item()  # fp32: float rounding only; bf16: rare ulp flips
        tol = (1e-5 if dtype == torch.float32 else 0.05) * scale
        torch.testing.assert_close(after, before, atol=tol, rtol=0)
