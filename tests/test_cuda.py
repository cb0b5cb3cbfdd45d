"""What must also hold on a GPU (skipped without CUDA): the attention kinds, the chunked head, the
deterministic embedding gradient and the policies' exactness, on CUDA kernels."""
import pytest
import torch

from picockpt import Config, init_params, loss_and_grads
from picockpt.inventory import predicted_peak_bytes
from picockpt.measure import make_batch
from picockpt.ops import embedding_backward
from picockpt.tracker import Tracker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POLICIES = ("none", "full", "every:2", "selective", "cheap")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def setup(**fields):
    cfg = Config.from_preset("tiny", layers=4, max_seq=256, **fields)
    params = init_params(cfg, seed=0, device="cuda")
    ids, targets = make_batch(cfg, 2, 96, "cuda", 0)
    return cfg, params, ids, targets


@pytest.mark.parametrize("attention,dtype", [("eager", "bf16"), ("eager", "fp32"), ("tiled", "fp32")])
def test_every_policy_bitwise_equal_to_none_on_cuda(attention, dtype):
    cfg, params, ids, targets = setup(attention=attention, attention_tile=32, dtype=dtype, dropout=0.1)
    torch.manual_seed(0)
    base = loss_and_grads(params, cfg, ids, targets, "none")
    for policy in POLICIES:
        torch.manual_seed(0)
        with Tracker("cuda", flops=False) as tracker:
            loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
        assert torch.equal(loss, base[0]), policy
        assert [k for k in grads if not torch.equal(grads[k], base[1][k])] == [], policy
        assert tracker.peak_logical == predicted_peak_bytes(cfg, 2, 96, policy), policy


def test_fused_flash_kernel_matches_eager_in_bf16():
    """The CUDA flash kernel's backward may add in any order (atomics): losses are compared bitwise
    across policies, gradients against eager's within bf16's precision."""
    cfg, params, ids, targets = setup(attention="fused", dtype="bf16")
    eager = loss_and_grads(params, cfg.replace(attention="eager"), ids, targets)
    fused = loss_and_grads(params, cfg, ids, targets)
    assert rel(fused[0], eager[0]) < 1e-2
    for name in eager[1]:
        assert rel(fused[1][name], eager[1][name]) < 5e-2, name
    for policy in POLICIES:
        assert torch.equal(loss_and_grads(params, cfg, ids, targets, policy)[0], fused[0]), policy
    with pytest.raises(ValueError, match="flash kernel, which takes bf16 or fp16"):
        loss_and_grads(params, cfg.replace(dtype="fp32"), ids, targets)


def test_chunked_head_matches_whole_logits_on_cuda():
    cfg, params, ids, targets = setup(dtype="fp32")
    whole = loss_and_grads(params, cfg, ids, targets)
    chunked = loss_and_grads(params, cfg.replace(loss_chunk=50), ids, targets)
    assert rel(chunked[0], whole[0]) < 1e-5
    for name in whole[1]:
        assert rel(chunked[1][name], whole[1][name]) < 1e-5, name


def test_embedding_gradient_is_deterministic_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 7, (8, 512), device="cuda", generator=g)  # many repeats of few ids: atomics would race
    dy = torch.randn(8, 512, 64, device="cuda", generator=g).to(torch.bfloat16)
    first = embedding_backward(dy, ids, (7, 64))
    assert first.dtype == torch.float32
    assert all(torch.equal(first, embedding_backward(dy, ids, (7, 64))) for _ in range(5))
