# The bf16 peer of `strata bench step --dtype bf16 --peers DIR`: PyTorch eager GPT-2
# training steps in bf16 mixed precision as PyTorch users run them on a CPU: fp32
# parameters, the forward under torch.autocast(device_type="cpu", dtype=torch.bfloat16),
# the backward outside it, fused AdamW on the fp32 parameters. The model, data and
# timing are those of ../shared/anchors/gpt2_step_bench.py (transformers'
# GPT2LMHeadModel, eager attention, no dropout, one random batch), so the fp32 and bf16
# peers differ only in autocast. Embedded in the strata binary and run with the Python
# of the peers' env; it appends one JSON line to --json.
import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = GPT2Config(
        n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
        vocab_size=args.vocab, n_positions=args.ctx,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=min(50256, args.vocab - 1), eos_token_id=min(50256, args.vocab - 1),
    )
    try:
        model = GPT2LMHeadModel(cfg, attn_implementation="eager")
    except TypeError:
        cfg._attn_implementation = "eager"
        model = GPT2LMHeadModel(cfg)
    model = model.float().train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                            eps=1e-8, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    def step():
        t0 = time.perf_counter()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        return out.loss.item(), t1 - t0, t2 - t1

    print(f"# torch {torch.__version__} threads={torch.get_num_threads()} bf16 autocast, "
          f"params={n_params:,} batch={args.batch} seq={args.seq}", flush=True)
    for i in range(args.warmup):
        loss, fb, op = step()
        print(f"warmup {i}: loss={loss:.4f} fwd+bwd={fb:.3f}s opt={op:.3f}s", flush=True)
    fbs, ops, tots = [], [], []
    for i in range(args.steps):
        loss, fb, op = step()
        fbs.append(fb)
        ops.append(op)
        tots.append(fb + op)
        print(f"step {i}: loss={loss:.4f} total={fb + op:.3f}s", flush=True)
    med = statistics.median(tots)
    res = {
        "tool": "torch-eager-bf16-autocast", "layers": args.layers, "heads": args.heads,
        "embd": args.embd, "vocab": args.vocab, "ctx": args.ctx, "batch": args.batch,
        "seq": args.seq, "threads": args.threads, "params": n_params,
        "autocast": "bfloat16", "fused": True,
        "median_step_s": med, "min_step_s": min(tots),
        "median_fwd_bwd_s": statistics.median(fbs), "median_opt_s": statistics.median(ops),
        "tokens_per_s": args.batch * args.seq / med, "steps": args.steps,
        "warmup": args.warmup, "final_loss": loss,
    }
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
