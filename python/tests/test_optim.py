"""strata.optim.CPUAdamW against torch.optim.AdamW: the golden case, live runs with param
groups and a scheduler, state dicts both ways, bf16/fp16 parameters and gradients, the
working copy, 8-bit state, and every refusal."""

import copy
import math

import numpy as np
import pytest
import torch

from conftest import DATA, read_safetensors
from strata.optim import CPUAdamW

RTOL, ATOL = 1e-6, 1e-7  # per element, per step (as the kernels' golden test)


def assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    err = np.abs(actual - expected)
    tol = atol + rtol * np.abs(expected)
    worst = int(np.argmax(err - tol))
    assert np.all(err <= tol), (
        f"{what}: element {worst} is {actual.flat[worst]!r}, expected {expected.flat[worst]!r} "
        f"(error {err.flat[worst]:.3e}, tolerance {tol.flat[worst]:.3e})"
    )


def test_golden_adamw_case_within_1e6_per_step():
    g = read_safetensors(DATA / "adamw" / "adamw.safetensors")
    p = torch.nn.Parameter(torch.from_numpy(g["p0"].copy()))
    opt = CPUAdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for k in (1, 2, 3):
        p.grad = torch.from_numpy(g[f"g{k}"].copy())
        opt.step()
        assert_close(p.detach().numpy(), g[f"p{k}"], f"parameters after step {k}")
        # Compare each step from the golden start, so errors cannot accumulate.
        with torch.no_grad():
            p.copy_(torch.from_numpy(g[f"p{k}"].copy()))
    st = opt.state[p]
    assert_close(st["exp_avg"].numpy(), g["m"], "m")
    assert_close(st["exp_avg_sq"].numpy(), g["v"], "v")
    assert float(st["step"]) == 3.0


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 5)
    )


def _groups(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr * 0.5},
    ]


def _train(model, opt, sched, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 37, generator=gen)
        y = torch.randn(16, 5, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def test_matches_torch_adamw_with_param_groups_and_a_scheduler():
    ours, theirs = _model(0), _model(0)
    opt_a = CPUAdamW(_groups(ours, 3e-3), lr=3e-3, betas=(0.8, 0.99), eps=1e-7)
    opt_b = torch.optim.AdamW(_groups(theirs, 3e-3), lr=3e-3, betas=(0.8, 0.99), eps=1e-7)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=3, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        x = torch.randn(16, 37, generator=gen)
        y = torch.randn(16, 5, generator=gen)
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        # The same gradients into both, so each step is compared alone.
        for pa, pb in zip(ours.parameters(), theirs.parameters()):
            pa.grad.copy_(pb.grad)
        opt_a.step()
        opt_b.step()
        sched_a.step()
        sched_b.step()
        for i, (pa, pb) in enumerate(zip(ours.parameters(), theirs.parameters())):
            assert_close(pa.detach().numpy(), pb.detach().numpy(), f"step {step} tensor {i}")
            with torch.no_grad():
                pa.copy_(pb)
    assert opt_a.param_groups[1]["lr"] == opt_b.param_groups[1]["lr"] == 3e-3 * 0.5 * 0.25


def test_fp32_state_dict_moves_between_cpuadamw_and_torch_adamw():
    a, b = _model(2), _model(2)
    opt_a = CPUAdamW(a.parameters(), lr=1e-2)
    _train(a, opt_a, None, 3)
    # torch's state_dict hands out the optimizer's own tensors: copy them.
    state = copy.deepcopy(opt_a.state_dict())
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(state)
    la = _train(a, opt_a, None, 2, seed=7)
    lb = _train(b, opt_b, None, 2, seed=7)
    assert la == pytest.approx(lb, rel=1e-5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close(pa.detach().numpy(), pb.detach().numpy(), "after resuming in torch", rtol=1e-5)
    # And back: torch's state dict into CPUAdamW.
    c = _model(2)
    c.load_state_dict(b.state_dict())
    opt_c = CPUAdamW(c.parameters(), lr=1e-2)
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    lb = _train(b, opt_b, None, 2, seed=9)
    lc = _train(c, opt_c, None, 2, seed=9)
    assert lc == pytest.approx(lb, rel=1e-5)
    assert float(opt_c.state[next(c.parameters())]["step"]) == 7.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_keep_an_fp32_master_and_get_the_rounded_update(dtype):
    torch.manual_seed(3)
    master = torch.randn(1000)
    p = torch.nn.Parameter(master.to(dtype))
    ref = torch.nn.Parameter(p.detach().float().clone())
    opt = CPUAdamW([p], lr=1e-2, weight_decay=0.05)
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.05)
    for _ in range(3):
        g = torch.randn(1000).to(dtype)
        p.grad = g
        ref.grad = g.float()
        opt.step()
        opt_ref.step()
    st = opt.state[p]
    assert st["master"].dtype == torch.float32
    assert_close(st["master"].numpy(), ref.detach().numpy(), "master")
    assert torch.equal(p.detach(), st["master"].to(dtype)), "the parameter is the rounded master"


def test_attach_copy_writes_the_working_copy_in_the_same_step():
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(4097))
    copy = torch.zeros(4097, dtype=torch.bfloat16)
    opt = CPUAdamW([p], lr=1e-2)
    opt.attach_copy(p, copy)
    p.grad = torch.randn(4097)
    opt.step()
    assert torch.equal(copy, p.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="elements"):
        opt.attach_copy(p, torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        opt.attach_copy(p, torch.zeros(4097, dtype=torch.float32))


def test_q8_state_trains_like_fp32_and_is_a_quarter_of_the_bytes():
    a, b = _model(5), _model(5)
    opt_a = CPUAdamW(a.parameters(), lr=3e-3, state="q8")
    opt_b = CPUAdamW(b.parameters(), lr=3e-3)
    la = _train(a, opt_a, None, 30)
    lb = _train(b, opt_b, None, 30)
    assert la[-1] < 0.8 * la[0], la
    assert abs(la[-1] - lb[-1]) < 0.05 * lb[-1], (la[-1], lb[-1])
    w = a[0].weight
    st = opt_a.state[w]
    q8_bytes = sum(t.numel() * t.element_size() for k, t in st.items() if k != "step")
    assert q8_bytes <= 0.26 * 8 * w.numel() + 64
    # A q8 state dict loads into an fp32 optimizer (expanded) and back (quantized).
    c = _model(5)
    c.load_state_dict(a.state_dict())
    opt_c = CPUAdamW(c.parameters(), lr=3e-3)
    opt_c.load_state_dict(opt_a.state_dict())
    assert opt_c.state[c[0].weight]["exp_avg"].shape == w.shape
    opt_d = CPUAdamW(c.parameters(), lr=3e-3, state="q8")
    opt_d.load_state_dict(opt_c.state_dict())
    assert torch.equal(opt_d.state[c[0].weight]["m_codes"], st["m_codes"])


def test_threads_do_not_change_the_result():
    torch.manual_seed(6)
    p0, g = torch.randn(100003), torch.randn(100003)
    out = []
    for threads in (1, 2):
        p = torch.nn.Parameter(p0.clone())
        p.grad = g.clone()
        CPUAdamW([p], threads=threads).step()
        out.append(p.detach())
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(maximize=True), "maximize"),
        (dict(state="fp8"), "state"),
        (dict(state="bf16"), "state"),
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(0.9, 1.0)), "beta"),
        (dict(threads=0), "threads"),
    ],
)
def test_unsupported_options_raise_value_error(kwargs, message):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=message):
        CPUAdamW([p], **kwargs)


def test_sparse_gradients_raise_value_error():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        CPUAdamW(emb.parameters()).step()


def test_wrong_dtype_parameter_raises_type_error():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        CPUAdamW([p]).step()


def test_non_contiguous_parameter_raises_value_error():
    p = torch.nn.Parameter(torch.zeros(8, 4).t())
    p.grad = torch.zeros(8, 4).t()
    with pytest.raises(ValueError, match="not contiguous"):
        CPUAdamW([p]).step()


def test_a_gradient_off_the_cpu_raises_type_error():
    # No GPU is needed to reach the check: a meta tensor is not on the CPU either.
    p = torch.nn.Parameter(torch.zeros(3))
    opt = CPUAdamW([p])
    st = opt.state[p]
    opt._init_state(p, st)
    from strata import _native

    with pytest.raises(TypeError, match="meta tensor"):
        _native.adamw_step(p, torch.zeros(3, device="meta"), [st["exp_avg"], st["exp_avg_sq"]],
                           (1e-3, 0.9, 0.999, 1e-8, 0.0), 1, 1.0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_parameter_raises_type_error():
    p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    p.grad = torch.zeros(3, device="cuda")
    with pytest.raises(TypeError, match="cuda tensor"):
        CPUAdamW([p]).step()


def test_shared_memory_between_state_and_gradient_is_refused():
    from strata import _native

    buf = torch.zeros(8)
    m, v = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="share memory"):
        _native.adamw_step(buf, buf, [m, v], (1e-3, 0.9, 0.999, 1e-8, 0.0), 1, 1.0, 1)
    with pytest.raises(ValueError, match="elements"):
        _native.adamw_step(buf, torch.zeros(7), [m, v], (1e-3, 0.9, 0.999, 1e-8, 0.0), 1, 1.0, 1)
    with pytest.raises(TypeError, match="torch tensor or a numpy array"):
        _native.adamw_step([0.0] * 8, buf, [m, v], (1e-3, 0.9, 0.999, 1e-8, 0.0), 1, 1.0, 1)


def test_numpy_arrays_are_used_in_place():
    from strata import _native

    p = np.ones(100, dtype=np.float32)
    g = np.full(100, 0.5, dtype=np.float32)
    m, v = np.zeros(100, np.float32), np.zeros(100, np.float32)
    _native.adamw_step(p, g, [m, v], (0.1, 0.9, 0.999, 1e-8, 0.0), 1, 1.0, 1)
    # Step 1 of Adam moves every element by lr * sign(g) (m/sqrt(v) after bias correction).
    assert np.allclose(p, 1.0 - 0.1, atol=1e-6)
    assert np.allclose(m, 0.05)
    with pytest.raises(ValueError, match="read-only"):
        p.setflags(write=False)
        _native.adamw_step(p, g, [m, v], (0.1, 0.9, 0.999, 1e-8, 0.0), 2, 1.0, 1)
    assert not math.isnan(float(p[0]))
