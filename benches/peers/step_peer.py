# strata's own peer of `strata bench step --peers DIR`: training steps of a randomly
# initialised transformers model built from the config.json strata writes for its own
# shape (`AutoModelForCausalLM.from_config`: GPT-2, Llama, Mistral, Qwen2, Qwen3), fp32
# parameters, eager attention, one random batch, AdamW (lr from --lr, betas
# (0.9, 0.999), eps 1e-8, weight decay 0.01), timed as ../shared/anchors' GPT-2 peers
# time theirs:
#   --engine eager         PyTorch eager, fused AdamW (all-on-device's peer); with
#                          --autocast bf16 the forward runs under
#                          torch.autocast("cpu", dtype=torch.bfloat16), as PyTorch users
#                          run bf16 mixed precision on a CPU (the backward outside it,
#                          AdamW on the fp32 parameters)
#   --engine zero --offload cpu|nvme
#                          DeepSpeed ZeRO-3 with parameters and optimizer state
#                          offloaded to the CPU (ZeRO-Offload) or to NVMe under
#                          --nvme-path (ZeRO-Infinity), built under zero.Init with the
#                          eager model's initial weights copied in, as
#                          ../shared/anchors/ds_zero3_bench.py does for GPT-2
#   --lora RANK [--lora-alpha A] [--lora-targets NAMES]
#                          with --engine eager: the model wrapped with peft's LoRA
#                          (get_peft_model; dropout 0, no bias; NAMES comma-separated or
#                          all-linear), AdamW over the adapters alone (strata bench step
#                          --lora's peer)
# strata runs it for the bf16 peer, for the LoRA peers of any family and, for
# Llama-family models, for all three (the anchors' scripts build GPT-2 only). Embedded in the strata binary and run with the
# Python of the peers' env (DeepSpeed's environment set by strata); it appends one JSON
# line to --json.
import argparse
import json
import os
import statistics
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-json", required=True, help="the model's config.json")
    ap.add_argument("--engine", choices=["eager", "zero"], default="eager")
    ap.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager",
                    help="transformers' attn_implementation of the eager engine")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: the whole model trains)")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-targets", default="all-linear",
                    help="module names, comma-separated, or all-linear")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.engine == "zero" and args.offload == "nvme" and not args.nvme_path:
        ap.error("--offload nvme needs --nvme-path")
    if args.engine == "zero" and args.autocast != "none":
        ap.error("--autocast is for --engine eager")
    if args.engine == "zero" and args.lora:
        ap.error("--lora is for --engine eager")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with open(args.config_json) as f:
        hf = json.load(f)
    hf["torch_dtype"] = "float32"
    hf["use_cache"] = False
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf, f)
        cfg = AutoConfig.from_pretrained(d)

    def build():
        return AutoModelForCausalLM.from_config(
            cfg, attn_implementation=args.attn, torch_dtype=torch.float32
        )

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)

    lora = {}
    if args.engine == "eager":
        model = build().float().train()
        tool = "torch-eager"
        if args.lora:
            import peft
            from peft import LoraConfig, get_peft_model

            targets = args.lora_targets
            if targets != "all-linear":
                targets = [t.strip() for t in targets.split(",")]
            model = get_peft_model(model, LoraConfig(
                r=args.lora, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                target_modules=targets, bias="none", task_type="CAUSAL_LM"))
            model.train()
            tool = "peft-lora-eager"
            lora = {"peft": peft.__version__, "lora_rank": args.lora,
                    "lora_alpha": args.lora_alpha, "lora_targets": args.lora_targets}
        n_params = sum(p.numel() for p in model.parameters())
        trained = [p for p in model.parameters() if p.requires_grad]
        lora["trained_params"] = sum(p.numel() for p in trained)
        opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.999),
                                eps=1e-8, weight_decay=0.01, fused=True)
        if args.lora and args.attn == "sdpa":
            tool += "-sdpa"
        tool += "-bf16-autocast" if args.autocast == "bf16" else ""

        def step():
            t0 = time.perf_counter()
            if args.autocast == "bf16":
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                    out = model(input_ids=ids, labels=ids)
            else:
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            return out.loss.item(), t1 - t0, t2 - t1
    else:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        zero = {
            "stage": 3,
            "contiguous_gradients": True,
            "overlap_comm": False,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "sub_group_size": 1e9,
        }
        if args.offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        else:
            os.makedirs(args.nvme_path, exist_ok=True)
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path,
                                         "pin_memory": False, "buffer_count": 4}
            zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path,
                                     "pin_memory": False, "buffer_count": 5,
                                     "buffer_size": 1e8, "max_in_cpu": 1e9}
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1,
                    "single_submit": False, "overlap_events": True},
            "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False,
        }
        # zero.Init skips the model's own weight initialisation: copy in the weights of
        # a normally built one (same seed), the eager peer's starting point.
        ref = build()
        sd = {n: p.detach().clone() for n, p in ref.named_parameters()}
        del ref
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build()
        for n, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(sd[n])
        del sd
        model = model.float().train()
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config)
        tool = f"deepspeed-zero3-offload-{args.offload}"

        def step():
            t0 = time.perf_counter()
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            t1 = time.perf_counter()
            engine.step()
            t2 = time.perf_counter()
            return out.loss.item(), t1 - t0, t2 - t1

    print(f"# torch {torch.__version__} threads={torch.get_num_threads()} {tool} "
          f"{cfg.model_type} params={n_params:,} batch={args.batch} seq={args.seq}"
          + (f" trained={lora['trained_params']:,}" if args.lora else ""), flush=True)
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
        "tool": tool, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
        "width": cfg.hidden_size, "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None),
        "intermediate": getattr(cfg, "intermediate_size", None),
        "vocab": cfg.vocab_size, "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "params": n_params, "autocast": args.autocast,
        "attn": args.attn,
        "median_step_s": med, "min_step_s": min(tots),
        "median_fwd_bwd_s": statistics.median(fbs), "median_opt_s": statistics.median(ops),
        "tokens_per_s": args.batch * args.seq / med, "steps": args.steps,
        "warmup": args.warmup, "final_loss": loss, **lora,
    }
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
