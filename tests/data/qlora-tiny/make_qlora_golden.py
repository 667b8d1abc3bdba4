"""Reference data for QLoRA: the LoRA run of make_lora_golden.py again, its frozen base quantised by
bitsandbytes to NF4 with double quantisation, as transformers loads a model with
BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.float32), on the CPU, in float32.

usage: python make_qlora_golden.py OUTDIR --lora LORA_DIR
LORA_DIR is make_lora_golden.py's output (shared/golden/lora-tiny): its base/, adapter0/, tokens.bin and
meta.json (rank, alpha, targets, batching, AdamW settings and plain-LoRA losses are taken from there).
Writes OUTDIR/expected/ (peft adapter after the steps), OUTDIR/grads0.safetensors (step-0 gradient of every
lora_A / lora_B, peft's names, f32), OUTDIR/dequant.safetensors (per quantised linear weight, under its HF
name: the dequantised f32 values, and its bitsandbytes state as `<name>.codes` (packed, u8), `.absmax_q`
(u8), `.absmax_scale` (f32, one per 256 blocks), `.offset` (f32, shape [1])) and OUTDIR/meta.json (losses
before each update next to the plain-LoRA ones, versions, settings, and what the checks below found).

Two things bitsandbytes 0.50.2 does on a CPU that the format does not (both avoided here):
- its native CPU dequantize_4bit kernel gives wrong values for a weight whose last dimension (in_features)
  is not a multiple of the block size: values take another block's absmax (here every down_proj, in 96).
  Dequantising the same state as a flat (1, n) tensor is right. This script counts the wrong values, then
  replaces the op's CPU kernel with bitsandbytes' own portable one (backends/default, flat blocks, what its
  CPU backend already uses for odd widths) and checks that it equals the native kernel run flat, bit for bit.
- a Linear4bit in eval mode without gradients, on a CPU with AVX512-BF16, runs a fused kernel that
  computes in bfloat16 whatever the compute dtype. Training mode (used here throughout) dequantises to
  float32 and calls F.linear.

Checks made on the way (each fails the script if it does not hold):
- every Linear4bit's state equals bitsandbytes.functional.quantize_4bit of the checkpoint's f32 weight;
- the quantised model's step-0 loss and adapter gradients equal, bit for bit, those of the plain f32 model
  whose linear weights are replaced by dequant.safetensors;
- strata's quantiser (kernels/src/kernel/quant/format.rs), emulated here in float32: which of its absmax
  codes differ from bitsandbytes' (each must be one where bitsandbytes' CPU search is not the nearest),
  and how many dequantised values differ from dequant.safetensors, given bitsandbytes' offset and with
  strata's own (an f64 mean rounded once, where bitsandbytes takes torch's float32 mean).
"""
import argparse, json, os
import numpy as np
import torch
import bitsandbytes as bnb
import bitsandbytes.functional as bf
import peft
import transformers as tf
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
from bitsandbytes.backends.utils import _get_4bit_code
from peft import PeftModel
from safetensors.torch import load_file, save_file

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--lora", required=True, help="make_lora_golden.py's output folder")
a = ap.parse_args()
lora_meta = json.load(open(os.path.join(a.lora, "meta.json")))
B, T, V, steps = lora_meta["batch"], lora_meta["seq"], lora_meta["vocab"], lora_meta["steps"]
base_dir, adapter0 = os.path.join(a.lora, "base"), os.path.join(a.lora, "adapter0")
os.makedirs(a.out, exist_ok=True)

raw = open(os.path.join(a.lora, "tokens.bin"), "rb").read()
header = np.frombuffer(raw[:1024], dtype="<i4")
tokens = torch.tensor(np.frombuffer(raw[1024:], dtype="<u2" if header[1] == 1 else "<u4").astype(np.int64))


def loss_of(model, k):
    w = tokens[k * B * T: (k + 1) * B * T + 1]
    x, y = w[:-1].view(B, T), w[1:].view(B, T)
    return torch.nn.functional.cross_entropy(model(input_ids=x).logits.view(-1, V), y.reshape(-1))


def portable_dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype):
    """bitsandbytes' portable dequantiser (flat blocks), as its CPU backend calls it for odd widths."""
    A = A if A.dtype == torch.uint8 else A.view(torch.uint8)
    return _dequantize_4bit_compute(A.reshape(-1), absmax.float(), _get_4bit_code(quant_type, A.device),
                                    blocksize, shape, dtype)


def native_cpu_dequantize(packed, qs, shape):
    """The op as registered for the CPU before the replacement, absmaxes as functional.dequantize_4bit makes them."""
    absmax = bf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    return torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, qs.blocksize, qs.quant_type, shape,
                                                          torch.float32).reshape(qs.shape)


qcfg = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
base = tf.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qcfg, dtype=torch.float32,
                                               device_map="cpu", attn_implementation="eager")
model = PeftModel.from_pretrained(base, adapter0, is_trainable=True)
model.train()  # see the docstring: eval mode on an AVX512-BF16 CPU would compute the base in bf16

weights = load_file(os.path.join(base_dir, "model.safetensors"))
linears = {n.replace("base_model.model.", "").replace(".base_layer", ""): m
           for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
states, native_2d, native_flat = {}, {}, {}
for name, m in sorted(linears.items()):
    qs, packed = m.weight.quant_state, m.weight.data
    assert qs.nested and qs.blocksize == 64 and qs.state2.blocksize == 256 and qs.quant_type == "nf4", name
    assert m.compute_dtype == torch.float32, name
    w = weights[name + ".weight"]
    p2, q2 = bf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(p2, packed) and torch.equal(q2.absmax, qs.absmax), name
    assert torch.equal(q2.state2.absmax, qs.state2.absmax) and torch.equal(q2.offset, qs.offset), name
    native_2d[name] = native_cpu_dequantize(packed, qs, qs.shape)
    native_flat[name] = native_cpu_dequantize(packed, qs, [w.numel()])
    states[name] = dict(w=w, packed=packed, qs=qs)
with torch.no_grad():
    native_loss0 = loss_of(model, 0).item()

torch.library.register_kernel("bitsandbytes::dequantize_4bit", "cpu", portable_dequantize_4bit)
dequant, native_wrong = {}, {}
for name, s in states.items():
    dq = bf.dequantize_4bit(s["packed"], s["qs"]).contiguous()
    assert dq.dtype == torch.float32 and dq.shape == s["w"].shape, name
    assert torch.equal(dq.view(torch.int32), native_flat[name].view(torch.int32)), name
    dequant[name + ".weight"] = dq
    native_wrong[name + ".weight"] = int((dq.view(torch.int32) != native_2d[name].view(torch.int32)).sum())
out = dict(dequant)
for name, s in states.items():
    qs = s["qs"]
    out.update({f"{name}.weight.codes": s["packed"].reshape(-1), f"{name}.weight.absmax_q": qs.absmax,
                f"{name}.weight.absmax_scale": qs.state2.absmax, f"{name}.weight.offset": qs.offset.reshape(1)})
save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(a.out, "dequant.safetensors"))


def strata_quantise(x, offset, dyn, nf4):
    """format.rs's Nf4Blocks::quantize_with_offset and dequantisation, in float32 numpy: codes are the number
    of codebook midpoints strictly below x * (1 / absmax) (so the nearest level, a midpoint taking the lower)."""
    f = np.float32
    n_mid = ((nf4[:-1] + nf4[1:]) / f(2)).astype(f)
    d_mid = ((dyn[:-1] + dyn[1:]) / f(2)).astype(f)
    blocks = np.pad(x, (0, (-len(x)) % 64)).reshape(-1, 64)
    absmax = np.abs(blocks).max(axis=1).astype(f)
    inv = (f(1) / np.maximum(absmax, f(1e-38))).astype(f)
    codes = np.searchsorted(n_mid, np.clip(blocks * inv[:, None], -1, 1).astype(f).reshape(-1)[:len(x)], "left")
    codes = np.pad(codes.astype(np.uint8), (0, len(x) % 2), constant_values=7)
    q, scales = [], []
    for g in range(0, len(absmax), 256):
        centred = (absmax[g:g + 256] - offset).astype(f)
        scale = f(np.abs(centred).max())
        scales.append(scale)
        inv_s = f(1) / max(scale, f(1e-38))
        q.append(np.searchsorted(d_mid, np.clip(centred * inv_s, -1, 1).astype(f), "left"))
    q, scales = np.concatenate(q).astype(np.uint8), np.array(scales, dtype=f)
    absmax_dq = (dyn[q] * np.repeat(scales, 256)[:len(q)]).astype(f) + offset
    values = (nf4[codes[:len(x)]] * np.repeat(absmax_dq, 64)[:len(x)]).astype(f)
    return dict(packed=(codes[0::2] << 4 | codes[1::2]).astype(np.uint8), absmax=absmax, q=q, scales=scales,
                values=values)


def strata_rule(name, s):
    qs = s["qs"]
    x = s["w"].reshape(-1).numpy()
    dyn, nf4 = qs.state2.code.numpy(), qs.code.numpy()
    theirs_q, theirs_scales = qs.absmax.numpy(), qs.state2.absmax.numpy()
    theirs_offset = np.float32(qs.offset.item())
    golden = dequant[name + ".weight"].reshape(-1).numpy()
    result = {}
    block_absmax = np.abs(np.pad(x, (0, (-len(x)) % 64)).reshape(-1, 64)).max(axis=1)
    own_offset = np.float32(sum(float(v) for v in block_absmax) / len(block_absmax))  # sequential f64 sum
    for which, offset in (("bnb_offset", theirs_offset), ("own_offset", own_offset)):
        ours = strata_quantise(x, offset, dyn, nf4)
        off = np.nonzero(ours["q"] != theirs_q)[0]
        if which == "bnb_offset":
            assert np.array_equal(ours["packed"], s["packed"].reshape(-1).numpy()), name
            assert np.array_equal(ours["scales"], theirs_scales), name
            for b in off:  # each must be a block where bitsandbytes' code is farther than ours
                v = np.float64(ours["absmax"][b] - offset) / np.float64(theirs_scales[b // 256])
                assert abs(v - dyn[ours["q"][b]]) < abs(v - dyn[theirs_q[b]]), (name, b)
        result[which] = dict(absmax_codes_differing=[int(b) for b in off],
                             values_differing=int((ours["values"].view(np.uint32) != golden.view(np.uint32)).sum()),
                             max_abs_difference=float(np.abs(ours["values"] - golden).max()))
    result["own_offset_ulps"] = abs(int(own_offset.view(np.int32)) - int(theirs_offset.view(np.int32)))
    result["absmax_codes"] = len(theirs_q)
    return result


rule = {name + ".weight": strata_rule(name, s) for name, s in states.items()}
rule_totals = dict(
    absmax_codes=sum(r["absmax_codes"] for r in rule.values()),
    absmax_codes_off_nearest=sum(len(r["bnb_offset"]["absmax_codes_differing"]) for r in rule.values()),
    values_differing_with_bnb_offset=sum(r["bnb_offset"]["values_differing"] for r in rule.values()),
    tensors_whose_own_offset_differs=sum(r["own_offset_ulps"] > 0 for r in rule.values()),
    largest_offset_difference_ulps=max(r["own_offset_ulps"] for r in rule.values()),
    values_differing_with_own_offset=sum(r["own_offset"]["values_differing"] for r in rule.values()),
    max_abs_difference_with_own_offset=max(r["own_offset"]["max_abs_difference"] for r in rule.values()),
)
print("strata's rule against bitsandbytes:", rule_totals)

# The same step 0 on the plain f32 model with the dequantised weights: bitsandbytes computes with them.
plain = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
with torch.no_grad():
    for n, p in plain.named_parameters():
        if n in dequant:
            p.copy_(dequant[n])
plain = PeftModel.from_pretrained(plain, adapter0, is_trainable=True)
plain.train()
plain_loss = loss_of(plain, 0)
plain_loss.backward()
plain_grads = {n.replace(".default", ""): p.grad for n, p in plain.named_parameters() if "lora_" in n}

params = [p for p in model.parameters() if p.requires_grad]
assert all("lora_" in n and p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
adamw = lora_meta["adamw"]
opt = torch.optim.AdamW(params, lr=lora_meta["lr"], betas=tuple(adamw["betas"]), eps=adamw["eps"],
                        weight_decay=adamw["weight_decay"], foreach=False)
losses = []
for k in range(steps):
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, k)
    loss.backward()
    if k == 0:
        grads = {n.replace(".default", ""): p.grad.detach().clone().contiguous()
                 for n, p in model.named_parameters() if "lora_" in n}
        save_file(grads, os.path.join(a.out, "grads0.safetensors"))
        assert loss.item() == plain_loss.item(), (loss.item(), plain_loss.item())
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    opt.step()
    losses.append(loss.item())
model.save_pretrained(os.path.join(a.out, "expected"), safe_serialization=True)
os.remove(os.path.join(a.out, "expected", "README.md"))  # peft's empty model card

meta = dict(
    base="../lora-tiny/base", adapter0="../lora-tiny/adapter0", tokens="../lora-tiny/tokens.bin",
    quantization=dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                      bnb_4bit_compute_dtype="float32", blocksize=64, nested_blocksize=256,
                      quantised=sorted(n + ".weight" for n in linears),
                      not_quantised="embed_tokens, the norms and lm_head stay float32"),
    **{k: lora_meta[k] for k in ("family", "layers", "heads", "kv_heads", "embd", "inter", "vocab", "rank",
                                 "alpha", "targets", "batch", "seq", "steps", "lr", "wd", "adamw", "batching",
                                 "loss")},
    losses=losses, plain_lora_losses=lora_meta["losses"],
    loss_minus_plain=[q - p for q, p in zip(losses, lora_meta["losses"])],
    grads0_loss=losses[0],
    checks=dict(
        dequantised_base="step 0's loss and every adapter gradient equal bit for bit those of the f32 model "
                         "whose quantised weights are replaced by dequant.safetensors",
        native_cpu_dequantize_wrong_values=native_wrong,
        native_cpu_loss0=native_loss0,
        native_cpu_note="bitsandbytes' native CPU dequantize_4bit on the 2-D shape (wrong where in_features is "
                        "not a multiple of 64); replaced by its portable kernel, equal to the native one run "
                        "flat; native_cpu_loss0 is step 0's loss with the native kernel"),
    strata_rule=dict(totals=rule_totals, per_tensor=rule),
    torch=torch.__version__, transformers=tf.__version__, peft=peft.__version__, bitsandbytes=bnb.__version__,
    cpu_path="training mode: each quantised weight dequantised to float32, then F.linear",
)
json.dump(meta, open(os.path.join(a.out, "meta.json"), "w"), indent=1)
print(a.out, "losses", losses, "plain LoRA", lora_meta["losses"], "native CPU kernel loss0", native_loss0)
