"""strata.optim.CPUAdamW against torch.optim.AdamW: the golden case, live runs with param
groups and a scheduler, state dicts both ways, bf16/fp16 parameters and gradients, the
working copy, bf16 and 8-bit state, and every refusal."""

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


# bf16 rounds to nearest even with 8 significant bits: a stored moment is within
# 2^-8 of itself (relative; bf16's subnormals, below 1e-38, do not occur here). The f32
# arithmetic's own differences from torch's (about 1e-6 relative) are added on top.
BF16_U = 2.0**-8 + 2e-6


def _bf16_bound(ms, vs, hp, steps):
    """Per element, how far CPUAdamW(state="bf16") may be from torch.optim.AdamW after each
    step, from torch's moments ``ms[t]``, ``vs[t]`` (float64 arrays, step t = 1..steps).

    Rounding the stored m after step k by at most u|m_k| reaches step t scaled by
    beta1^(t-k), so |m~_t - m_t| <= A_t = beta1 (A_{t-1} + u (|m_{t-1}| + A_{t-1})); the
    same with beta2 for v (B_t). The update m / (sqrt(v)/c2 + eps) then moves by at most
    A/d + |m| dd/(d (d - dd)) with d = sqrt(v)/c2 + eps and dd = B/(sqrt(v) c2) (since
    |sqrt(v~) - sqrt(v)| <= |v~ - v| / sqrt(v)); the parameter's error is the decayed sum
    of those times lr / (1 - beta1^t), plus torch's own 1e-6 |p| + 1e-7 per step."""
    lr, (b1, b2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    a = b = e = 0.0
    bounds = []
    for t in range(1, steps + 1):
        if t > 1:
            a = b1 * (a + BF16_U * (np.abs(ms[t - 1]) + a))
            b = b2 * (b + BF16_U * (vs[t - 1] + b))
        m, v = ms[t], vs[t]
        c2 = math.sqrt(1 - b2**t)
        d = np.sqrt(v) / c2 + eps
        dd = b / np.maximum(np.sqrt(v), 1e-30) / c2
        assert np.all(dd < 0.5 * d), "the bound assumes the denominator's error is small"
        step_size = lr / (1 - b1**t)
        e = e * (1 - lr * wd) + step_size * (a / d + np.abs(m) * dd / (d * (d - dd)))
        bounds.append((e, a, b))
    return bounds


def test_bf16_state_tracks_torch_adamw_within_a_bound_from_bf16_precision():
    torch.manual_seed(8)
    n, steps = 20011, 6
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p0 = torch.randn(n)
    # Gradients over four decades, fixed in advance (not from the parameters), so the
    # two runs differ only by the state's rounding; every 97th exactly zero.
    grads = [torch.randn(n) * 10.0 ** torch.empty(n).uniform_(-3, 1) for _ in range(steps)]
    for g in grads:
        g[::97] = 0.0
    ours = torch.nn.Parameter(p0.clone())
    theirs = torch.nn.Parameter(p0.clone())
    opt_a = CPUAdamW([ours], state="bf16", **hp)
    opt_b = torch.optim.AdamW([theirs], **hp)
    ps, ms, vs = [None], [np.zeros(n)], [np.zeros(n)]
    got = []
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        sb = opt_b.state[theirs]
        ps.append(theirs.detach().double().numpy().copy())
        ms.append(sb["exp_avg"].double().numpy().copy())
        vs.append(sb["exp_avg_sq"].double().numpy().copy())
        sa = opt_a.state[ours]
        assert sa["exp_avg"].dtype == sa["exp_avg_sq"].dtype == torch.bfloat16
        got.append((ours.detach().double().numpy().copy(), sa["exp_avg"].double().numpy(),
                    sa["exp_avg_sq"].double().numpy()))
    bounds = _bf16_bound(ms, vs, hp, steps)
    worst = 0.0
    for t in range(1, steps + 1):
        p, m, v = got[t - 1]
        e, a, b = bounds[t - 1]
        tol_p = e + t * (1e-6 * np.abs(ps[t]) + 1e-7)
        # The stored moments are the step's f32 moments (within A_t, B_t of torch's)
        # rounded once more.
        tol_m = (a + BF16_U * (np.abs(ms[t]) + a)) * (1 + 1e-6) + 1e-30
        tol_v = (b + BF16_U * (vs[t] + b)) * (1 + 1e-6) + 1e-30
        for what, x, want, tol in (("p", p, ps[t], tol_p), ("m", m, ms[t], tol_m),
                                   ("v", v, vs[t], tol_v)):
            err = np.abs(x - want)
            i = int(np.argmax(err / tol))
            assert np.all(err <= tol), (
                f"step {t}: {what}[{i}] {x[i]!r} vs torch {want[i]!r}: error {err[i]:.3e} over "
                f"the bf16 bound {tol[i]:.3e}")
        worst = max(worst, float(np.max(np.abs(p - ps[t]) / tol_p)))
    # The state really is rounded: the runs differ, by a visible part of the bound.
    assert worst > 0.05, worst


def test_bf16_state_dict_moves_between_formats_and_into_torch():
    a, b = _model(9), _model(9)
    opt_a = CPUAdamW(a.parameters(), lr=1e-2, state="bf16")
    _train(a, opt_a, None, 3)
    state = copy.deepcopy(opt_a.state_dict())
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["state"][0]["exp_avg"].dtype == torch.bfloat16
    # Into torch.optim.AdamW (which widens the moments exactly) and on.
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(copy.deepcopy(state))
    w_a, w_b = a[0].weight, b[0].weight
    assert torch.equal(opt_b.state[w_b]["exp_avg"], opt_a.state[w_a]["exp_avg"].float())
    # Back into a bf16 CPUAdamW: the same bits, and the same next steps.
    c = _model(9)
    c.load_state_dict(a.state_dict())
    opt_c = CPUAdamW(c.parameters(), lr=1e-2, state="bf16")
    opt_c.load_state_dict(copy.deepcopy(state))
    assert torch.equal(opt_c.state[c[0].weight]["exp_avg_sq"], opt_a.state[w_a]["exp_avg_sq"])
    assert _train(c, opt_c, None, 2, seed=5) == _train(a, opt_a, None, 2, seed=5)
    # fp32 moments (torch's) round to nearest even as torch rounds them.
    opt_d = CPUAdamW(b.parameters(), lr=1e-2, state="bf16")
    opt_d.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    assert torch.equal(opt_d.state[w_b]["exp_avg"],
                       opt_b.state[w_b]["exp_avg"].to(torch.bfloat16))
    # 8-bit state expands into bf16, and bf16 quantizes into 8-bit.
    opt_q = CPUAdamW(b.parameters(), lr=1e-2, state="q8")
    opt_q.load_state_dict(copy.deepcopy(state))
    assert opt_q.state[w_b]["m_codes"].dtype == torch.uint8
    opt_e = CPUAdamW(b.parameters(), lr=1e-2, state="bf16")
    opt_e.load_state_dict(opt_q.state_dict())
    assert opt_e.state[w_b]["exp_avg"].dtype == torch.bfloat16
    m_e = opt_e.state[w_b]["exp_avg"].float()
    m_saved = state["state"][0]["exp_avg"].float()
    # E4M3 codes (within 1/16) of bf16 values, rounded to bf16 again (within 2^-8).
    assert torch.allclose(m_e, m_saved, rtol=0.07, atol=1e-4 * float(m_saved.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_state_with_low_precision_parameters_keeps_an_fp32_master(dtype):
    torch.manual_seed(10)
    p = torch.nn.Parameter(torch.randn(777).to(dtype))
    opt = CPUAdamW([p], lr=1e-2, state="bf16")
    for _ in range(2):
        p.grad = torch.randn(777).to(dtype)
        opt.step()
    st = opt.state[p]
    assert st["master"].dtype == torch.float32
    assert st["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(p.detach(), st["master"].to(dtype))


def test_bf16_state_bad_input_is_a_clear_error():
    from strata import _native

    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0)
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(TypeError, match="both moments must be float32 or both bfloat16"):
        _native.adamw_step(p, g, [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)],
                           hyper, 1, 1.0, 1)
    with pytest.raises(TypeError, match="float16"):
        _native.adamw_step(p, g, [torch.zeros(8, dtype=torch.float16)] * 2, hyper, 1, 1.0, 1)
    with pytest.raises(ValueError, match="elements"):
        _native.adamw_step(p, g, [torch.zeros(7, dtype=torch.bfloat16),
                                  torch.zeros(8, dtype=torch.bfloat16)], hyper, 1, 1.0, 1)
    with pytest.raises(ValueError, match="not contiguous"):
        m = torch.zeros(4, 4, dtype=torch.bfloat16).t()
        _native.adamw_step(torch.zeros(16), torch.zeros(16), [m, m.clone()], hyper, 1, 1.0, 1)
    with pytest.raises(ValueError, match="share memory"):
        m = torch.zeros(8, dtype=torch.bfloat16)
        _native.adamw_step(p, g, [m, m], hyper, 1, 1.0, 1)
    with pytest.raises(ValueError, match="state"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(3))], state="bfloat16")


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
        (dict(lr=-1.0), "lr = -1 is invalid"),
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


# Each promise of the README's "From Python" section about CPUAdamW, as a user meets it:
# everything is checked when the optimizer is built (or a group added, or a state dict
# loaded), and a step that refuses a tensor updates none.


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(lr="0.1"), TypeError, "lr must be a number"),
        (dict(lr=None), TypeError, "lr must be a number"),
        (dict(lr=float("inf")), ValueError, "lr = inf is invalid"),
        (dict(lr=torch.tensor([0.1, 0.2])), ValueError, "one element"),
        (dict(betas=0.9), TypeError, "betas must be a pair"),
        (dict(betas=(0.9,)), ValueError, "beta"),
        (dict(betas=("a", "b")), TypeError, "betas must be a pair"),
        (dict(betas=(float("nan"), 0.9)), ValueError, "beta1 = NaN is invalid"),
        (dict(eps="x"), TypeError, "eps must be a number"),
        (dict(eps=float("nan")), ValueError, "eps"),
        (dict(weight_decay=None), TypeError, "weight_decay must be a number"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay = inf is invalid"),
        (dict(threads=True), ValueError, "threads"),
        (dict(threads=2.0), ValueError, "threads"),
    ],
)
def test_hyperparameters_of_the_wrong_type_or_range_are_refused_at_construction(
    kwargs, error, message
):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(error, match=message):
        CPUAdamW([p], **kwargs)


def test_numpy_and_tensor_hyperparameters_are_numbers_as_for_torch():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = CPUAdamW([p], lr=np.float32(0.1), betas=(np.float64(0.9), torch.tensor(0.999)),
                   eps=np.float32(1e-8), weight_decay=np.int64(0))
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))


@pytest.mark.parametrize(
    "group, error, message",
    [
        (dict(amsgrad=True), ValueError, "amsgrad"),
        (dict(maximize=True), ValueError, "maximize"),
        (dict(lr="x"), TypeError, "lr must be a number"),
        (dict(lr=-1.0), ValueError, "lr = -1 is invalid"),
        (dict(betas=(2.0, 0.5)), ValueError, "beta1 = 2 is invalid"),
    ],
)
def test_a_param_group_is_checked_as_the_defaults_are(group, error, message):
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    with pytest.raises(error, match=message):
        CPUAdamW([{"params": [a]}, {"params": [b], **group}], lr=0.1)
    opt = CPUAdamW([a], lr=0.1)
    with pytest.raises(error, match=message):
        opt.add_param_group({"params": [b], **group})
    assert len(opt.param_groups) == 1  # the refused group was not kept


@pytest.mark.parametrize(
    "tensor, error, message",
    [
        (torch.zeros(3, dtype=torch.float64), TypeError, "float32, bfloat16 or float16"),
        (torch.zeros(3, dtype=torch.int32), TypeError, "float32, bfloat16 or float16"),
        (torch.zeros(3, device="meta"), TypeError, "meta tensor"),
        (torch.zeros(8, 4).t(), ValueError, "not contiguous"),
    ],
    ids=["float64", "int32", "meta", "non-contiguous"],
)
def test_a_parameter_strata_cannot_update_is_refused_at_construction(tensor, error, message):
    with pytest.raises(error, match=message):
        CPUAdamW([torch.nn.Parameter(tensor, requires_grad=tensor.is_floating_point())])


def test_a_step_that_refuses_one_tensor_updates_none():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = CPUAdamW([a, b], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = torch.ones(8)[::2]  # not contiguous: refused
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*not contiguous"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(4))  # the first tensor was not updated
    assert all(int(opt.state[p].get("step", torch.tensor(0.0))) == 0 for p in (a, b))
    # A learning rate set to something invalid after construction is refused the same way.
    b.grad = torch.ones(4)
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr = NaN is invalid"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(4))
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert int(opt.state[a]["step"]) == 1 and not torch.equal(a.detach(), torch.ones(4))


def test_a_state_dict_of_other_sizes_or_options_is_refused_before_anything_loads():
    a = torch.nn.Parameter(torch.zeros(4))
    a.grad = torch.ones(4)
    ref = torch.optim.AdamW([a])
    ref.step()
    b = torch.nn.Parameter(torch.zeros(5))
    b.grad = torch.ones(5)
    opt = CPUAdamW([b], lr=0.5)
    with pytest.raises(ValueError, match="4 elements.*5"):
        opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["lr"] == 0.5 and len(opt.state) == 0  # nothing loaded
    # torch's AdamW with amsgrad: CPUAdamW would ignore it; refused instead.
    c = torch.nn.Parameter(torch.zeros(5))
    c.grad = torch.ones(5)
    ams = torch.optim.AdamW([c], amsgrad=True)
    ams.step()
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(ams.state_dict())
    assert opt.param_groups[0]["amsgrad"] is False and len(opt.state) == 0
    # 8-bit state of another size is refused too, not found at the next step.
    q = CPUAdamW([a], state="q8")
    q.step()
    with pytest.raises(ValueError, match="4 elements.*5"):
        CPUAdamW([b], state="q8").load_state_dict(q.state_dict())
