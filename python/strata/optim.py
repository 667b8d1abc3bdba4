"""``CPUAdamW``: torch.optim.AdamW's semantics on strata's CPU SIMD AdamW kernel.

One pass per parameter tensor reads the parameter, its gradient and the two moments and
writes them back (and, if asked, a bf16/fp16 working copy of the updated parameters),
in place on the tensors' memory, with the GIL released. State is fp32 (the same keys and
tensors as torch.optim.AdamW, so state dicts move between the two), bf16 (the same keys,
bfloat16 tensors: 4 bytes per parameter) or 8-bit (``q8``: block-wise quantized m and
sqrt(v), 2 bytes per parameter plus a scale per 256).
"""

import torch

from . import _native

STATES = ("fp32", "bf16", "q8")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


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
        for name, value in (
            ("amsgrad", amsgrad),
            ("maximize", maximize),
            ("capturable", capturable),
            ("differentiable", differentiable),
        ):
            if value:
                raise ValueError(f"CPUAdamW does not support {name}=True")
        if state not in STATES:
            raise ValueError(f"state={state!r} is not one of {', '.join(map(repr, STATES))}")
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("a tensor lr must have one element")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if threads is None:
            threads = _native.max_threads()
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, not {threads!r}")
        self.threads = threads
        self.state_format = state
        # torch.optim.AdamW's keys, so that its load_state_dict accepts our param groups.
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
        )
        super().__init__(params, defaults)
        self._copies = {}

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
        for group in self.param_groups:
            lr = group["lr"]
            lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
            beta1, beta2 = (float(b) for b in group["betas"])
            hyper = (lr, beta1, beta2, float(group["eps"]), float(group["weight_decay"]))
            for p in group["params"]:
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
                st["step"] += 1
                _native.adamw_step(
                    master,
                    grad,
                    self._moments(st),
                    hyper,
                    int(st["step"].item()),
                    1.0,
                    self.threads,
                    copy_out,
                )
        return loss

    def load_state_dict(self, state_dict):
        """Loads a state dict of CPUAdamW or torch.optim.AdamW, whatever its state format:
        moments are rounded to nearest even for bf16 state, quantized for 8-bit state,
        widened (exactly) or expanded for fp32."""
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        # torch casts floating state to each parameter's dtype; strata keeps fp32 moments
        # and masters whatever the parameter's dtype, so take the saved tensors again.
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for index, p in zip(ids, params):
            if index not in saved:
                continue
            self.state[p] = self._convert(p, saved[index])

    def _convert(self, p, old):
        def f32(t):
            return t.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()

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
