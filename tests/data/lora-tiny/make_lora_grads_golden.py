"""Step-0 gradients of a LoRA adapter, for the data make_lora_golden.py wrote: the base model
and the initial adapter (adapter0) of OUTDIR, the first batch of OUTDIR/tokens.bin (B x T + 1
tokens, inputs and next-token targets, as make_golden_family.py batches), the mean
cross-entropy's gradient with respect to every lora_A and lora_B, in float32 (transformers +
peft on the CPU, eager attention), and the loss.

usage: python make_lora_grads_golden.py OUTDIR --batch 2 --seq 16
Writes OUTDIR/grads0.safetensors (peft's tensor names, as adapter_model.safetensors names them,
each the gradient of its tensor) and adds "grads0_loss" to OUTDIR/meta.json.
"""
import argparse, json, os
import numpy as np
import torch
import transformers as tf
from peft import PeftModel
from safetensors.torch import save_file

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--seq", type=int, default=16)
a = ap.parse_args()

raw = open(os.path.join(a.out, "tokens.bin"), "rb").read()
header = np.frombuffer(raw[:256 * 4], dtype=np.int32)
version = int(header[1])
ids = np.frombuffer(raw[256 * 4:], dtype=np.uint16 if version == 1 else np.uint32).astype(np.int64)
n = a.batch * a.seq
x = torch.tensor(ids[:n]).view(a.batch, a.seq)
y = torch.tensor(ids[1:n + 1]).view(a.batch, a.seq)

base = tf.AutoModelForCausalLM.from_pretrained(os.path.join(a.out, "base"), attn_implementation="eager").float()
model = PeftModel.from_pretrained(base, os.path.join(a.out, "adapter0"), is_trainable=True).float()
model.train()
logits = model(input_ids=x).logits
loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
loss.backward()
grads = {}
for name, p in model.named_parameters():
    if "lora_" in name:
        # peft saves "base_model.model.<module>.lora_A.weight" (without the adapter's name).
        grads[name.replace(".default", "")] = p.grad.detach().clone().contiguous()
save_file(grads, os.path.join(a.out, "grads0.safetensors"))
meta_path = os.path.join(a.out, "meta.json")
meta = json.load(open(meta_path))
meta["grads0_loss"] = loss.item()
json.dump(meta, open(meta_path, "w"), indent=1)
print("loss", loss.item(), "tensors", len(grads))
