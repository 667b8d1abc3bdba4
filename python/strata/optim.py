"""``CPUAdamW``: torch.optim.AdamW's semantics on strata's CPU SIMD AdamW kernel.

One pass per parameter tensor reads the parameter, its gradient and the two moments and
writes them back (and, if asked, a bf16/fp16 working copy of the updated parameters),
in place on the tensors' memory, with the GIL released. State is fp32 (the same keys and
tensors as torch.optim.AdamW, so state dicts move between the two), bf16 (the same keys,
bfloat16 tensors: 4 bytes per parameter) or 8-bit (``q8``: block-wise quantized m and
sqrt(v), 2 bytes per parameter plus a scale per 256).
"""

import numbers

import torch

from . import _native

STATES = ("fp32", "bf16", "q8")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, *_LOW_PRECISION)
#: torch.optim.AdamW's options that CPUAdamW does not compute: refused, never ignored.
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _number(name, value):
    # numbers.Real: Python's and numpy's ints and floats (numpy registers its scalars).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    return float(value)


def _hyper(group):
    """``(lr, beta1, beta2, eps, weight_decay)`` of a param group as floats, checked for
    their types here and their ranges by the kernel's rule (TypeError, ValueError)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"a tensor lr must have one element, not {lr.numel()}")
        lr = float(lr.item())
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"lr must be a number or a one-element tensor, not {type(lr).__name__}")
    else:
        lr = float(lr)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or not all(
        isinstance(b, (numbers.Real, torch.Tensor)) and not isinstance(b, bool) for b in betas
    ):
        raise TypeError(f"betas must be a pair of numbers, not {betas!r}")
    if len(betas) != 2:
        raise ValueError(f"Invalid beta parameters: {betas} (a pair: beta1, beta2)")
    hyper = (
        lr,
        float(betas[0]),
        float(betas[1]),
        _number("eps", group["eps"]),
        _number("weight_decay", group["weight_decay"]),
    )
    _native.adamw_check(hyper)
    return hyper


def _check_param(p):
    """A parameter strata can update: fp32, bf16 or fp16, on the CPU, contiguous."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"a parameter must be a torch tensor, not {type(p).__name__}")
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(f"CPUAdamW updates float32, bfloat16 or float16 parameters, not {p.dtype}")
    if p.device.type != "cpu":
        raise TypeError(
            f"a parameter is a {p.device.type} tensor; CPUAdamW updates CPU tensors "
            "(move it with .cpu())"
        )
    if not p.is_contiguous():
        raise ValueError(
            f"a parameter is not contiguous (strides {p.stride()}); pass .contiguous()"
        )


class CPUAdamW(torch.optim.Optimizer):
    """AdamW on the CPU, as ``torch.optim.AdamW`` computes it.

    Arguments as torch.optim.AdamW's, plus:

    - ``state``: ``"fp32"`` (torch's format), ``"bf16"`` (m and v stored as bfloat16,
      rounded to nearest even after each step's fp32 update; 4 B per parameter instead
      of 8; parameters and masters stay fp32) or ``"q8"`` (8-bit; about 2 B per
      parameter).
    - ``threads``: threads of strata's worker pool per update (default: all of them).

    Parameters may be fp32 (updated in place; gradients fp32) or bf16/fp16 (the
    optimizer then keeps an fp32 master copy in ``state["master"]``, reads the bf16/fp16
    gradients and writes the rounded update back into the parameter in the same pass).
    ``attach_copy(param, out)`` makes each step also write an fp32 parameter's update,
    rounded to ``out``'s bf16/fp16, into ``out`` (a GPU working copy's staging buffer).

    Not supported (ValueError): ``amsgrad=True``, ``maximize=True``, ``capturable=True``,
    ``differentiable=True``, sparse gradients.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        state="fp32",
        threads=None,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    ):
        if state not in STATES:
            raise ValueError(f"state={state!r} is not one of {', '.join(map(repr, STATES))}")
        if threads is None:
            threads = _native.max_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, not {threads!r}")
        self.threads = threads
        self.state_format = state
        # torch.optim.AdamW's keys, so that its load_state_dict accepts our param groups.
        # Each group, these defaults included, is checked by add_param_group.
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        super().__init__(params, defaults)
        self._copies = {}

    def add_param_group(self, param_group):
        """torch's ``add_param_group``, then this group checked as the constructor's
        arguments are (options, hyperparameters, each parameter's dtype, device and
        layout); a refused group is not kept."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for name in _UNSUPPORTED:
                if group.get(name):
                    raise ValueError(f"CPUAdamW does not support {name}=True")
            _hyper(group)
            for p in group["params"]:
                _check_param(p)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def attach_copy(self, param, out):
        """Each step also writes ``param``'s update, rounded, into ``out`` (bf16/fp16, as
        many elements, CPU, contiguous). ``out=None`` detaches."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("attach_copy: the parameter is not one of this optimizer's")
        if out is None:
            self._copies.pop(param, None)
            return
        if param.dtype in _LOW_PRECISION:
            raise ValueError(
                "attach_copy: this parameter is itself the bf16/fp16 copy of its fp32 master"
            )
        if not isinstance(out, torch.Tensor) or out.dtype not in _LOW_PRECISION:
            raise TypeError("attach_copy: out must be a bfloat16 or float16 tensor")
        if out.numel() != param.numel():
            raise ValueError(
                f"attach_copy: out has {out.numel()} elements, the parameter {param.numel()}"
            )
        self._copies[param] = out

    def _init_state(self, p, st):
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        if p.dtype in _LOW_PRECISION:
            st["master"] = p.detach().to(torch.float32).contiguous()
        elif p.dtype != torch.float32:
            raise TypeError(
                f"CPUAdamW updates float32, bfloat16 or float16 parameters, not {p.dtype}"
            )
        like = st.get("master", p)
        if self.state_format in ("fp32", "bf16"):
            dtype = torch.bfloat16 if self.state_format == "bf16" else torch.float32
            st["exp_avg"] = torch.zeros(like.shape, dtype=dtype)
            st["exp_avg_sq"] = torch.zeros(like.shape, dtype=dtype)
        else:
            codes, scales = _native.q8_sizes(p.numel())
            st["m_codes"] = torch.zeros(codes, dtype=torch.uint8)
            st["m_scales"] = torch.zeros(scales, dtype=torch.float32)
            st["v_codes"] = torch.zeros(codes, dtype=torch.uint8)
            st["v_scales"] = torch.zeros(scales, dtype=torch.float32)

    def _moments(self, st):
        if self.state_format in ("fp32", "bf16"):
            return [st["exp_avg"], st["exp_avg_sq"]]
        return [st["m_codes"], st["m_scales"], st["v_codes"], st["v_scales"]]

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything is checked before any tensor is updated: a refused tensor leaves
        # every parameter, moment and step count as it was.
        jobs, labels, states = [], [], []
        for g, group in enumerate(self.param_groups):
            hyper = _hyper(group)
            for i, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("CPUAdamW does not support sparse gradients")
                st = self.state[p]
                if len(st) == 0:
                    self._init_state(p, st)
                master = st.get("master")
                if master is None:
                    master, copy_out = p, self._copies.get(p)
                else:
                    copy_out = p
                step = int(st["step"].item()) + 1
                jobs.append((master, grad, self._moments(st), hyper, step, copy_out))
                labels.append(f"param_groups[{g}]['params'][{i}]")
                states.append(st)
        _native.adamw_steps(jobs, labels, 1.0, self.threads)
        for st in states:
            st["step"] += 1
        return loss

    def load_state_dict(self, state_dict):
        """Loads a state dict of CPUAdamW or torch.optim.AdamW, whatever its state format:
        moments are rounded to nearest even for bf16 state, quantized for 8-bit state,
        widened (exactly) or expanded for fp32."""
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        # Checked and converted before anything loads: a refused state dict leaves the
        # optimizer as it was.
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "the state dict's param groups have other sizes than this optimizer's "
                f"({[len(g['params']) for g in groups]} parameters against "
                f"{[len(g['params']) for g in self.param_groups]})"
            )
        for group in groups:
            for name in _UNSUPPORTED:
                if group.get(name):
                    raise ValueError(f"the state dict has {name}=True, which CPUAdamW does not support")
            _hyper(group)
        ids = [i for g in groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        converted = [(p, self._convert(p, saved[i], i)) for i, p in zip(ids, params) if i in saved]
        super().load_state_dict(state_dict)
        # torch casts floating state to each parameter's dtype; strata keeps fp32 moments
        # and masters whatever the parameter's dtype, so take the converted tensors.
        for p, st in converted:
            self.state[p] = st

    def _convert(self, p, old, index):
        def f32(t):
            return t.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()

        for key in ("exp_avg", "exp_avg_sq", "m_codes", "v_codes", "master"):
            if key in old and old[key].numel() != p.numel():
                raise ValueError(
                    f"the saved state of parameter {index} has {old[key].numel()} elements "
                    f"in {key}; the parameter has {p.numel()}"
                )
        st = {}
        step = old.get("step", 0.0)
        st["step"] = (
            f32(step).reshape(()) if isinstance(step, torch.Tensor) else torch.tensor(float(step))
        )
        if p.dtype in _LOW_PRECISION:
            st["master"] = f32(old["master"]) if "master" in old else f32(p)
        if "exp_avg" in old:
            m, v = f32(old["exp_avg"]).reshape(p.shape), f32(old["exp_avg_sq"]).reshape(p.shape)
            if self.state_format == "fp32":
                st["exp_avg"], st["exp_avg_sq"] = m, v
            elif self.state_format == "bf16":
                # torch's float-to-bfloat16 conversion rounds to nearest even, as the kernel.
                st["exp_avg"], st["exp_avg_sq"] = m.to(torch.bfloat16), v.to(torch.bfloat16)
            else:
                codes, scales = _native.q8_sizes(p.numel())
                q = [
                    torch.zeros(codes, dtype=torch.uint8),
                    torch.zeros(scales, dtype=torch.float32),
                    torch.zeros(codes, dtype=torch.uint8),
                    torch.zeros(scales, dtype=torch.float32),
                ]
                _native.q8_convert(m, v, q, True)
                st["m_codes"], st["m_scales"], st["v_codes"], st["v_scales"] = q
        elif "m_codes" in old:
            q = [
                old["m_codes"].detach().to("cpu", torch.uint8).contiguous().clone(),
                f32(old["m_scales"]),
                old["v_codes"].detach().to("cpu", torch.uint8).contiguous().clone(),
                f32(old["v_scales"]),
            ]
            if self.state_format == "q8":
                st["m_codes"], st["m_scales"], st["v_codes"], st["v_scales"] = q
            else:
                m = torch.zeros(p.shape, dtype=torch.float32)
                v = torch.zeros(p.shape, dtype=torch.float32)
                _native.q8_convert(m, v, q, False)
                if self.state_format == "bf16":
                    m, v = m.to(torch.bfloat16), v.to(torch.bfloat16)
                st["exp_avg"], st["exp_avg_sq"] = m, v
        else:
            raise ValueError(f"a saved state has neither exp_avg nor m_codes: {sorted(old)}")
        return st
