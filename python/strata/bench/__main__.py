"""``python -m strata.bench adam|io [options]``: see ``strata.bench``."""

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def cpu_model():
    """The model name with its family and model numbers, as `strata doctor` gives it."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def parse_count(text):
    text = str(text).strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# ---------------------------------------------------------------------------------------
# adam


def _adam_impls(threads):
    """(name, bytes moved per parameter, builder(params) -> step function, or an error)."""
    import torch

    from strata.optim import CPUAdamW

    impls = []
    for state, bytes_per_param in (
        ("fp32", 28.0),
        ("bf16", 4 + 4 + 4 + 2 * 2 + 2 * 2),
        ("q8", 4 + 4 + 4 + 2 + 2 + 2 * 2 * 4 / 256),
    ):
        # fp32: read p, g, m, v and write p, m, v (4 B each). bf16: p read and written,
        # g read, m and v (2 B each) read and written. q8: p read and written, g read,
        # 1 B codes of m and of sqrt(v) read and written, and per 256 parameters a 4 B
        # scale of each read and written.
        def build(params, state=state):
            opt = CPUAdamW(params, state=state, threads=threads, **HP)
            return opt.step

        impls.append((f"strata CPUAdamW(state={state!r})", bytes_per_param, build, None))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        def build_ds(params):
            opt = DeepSpeedCPUAdam(params, adamw_mode=True, bias_correction=True,
                                   fp32_optimizer_states=True, **HP)
            return opt.step

        impls.append(("DeepSpeedCPUAdam(adamw_mode=True)", 28.0, build_ds, None))
    except Exception as e:  # not installed, or its C++ op did not build
        impls.append(("DeepSpeedCPUAdam(adamw_mode=True)", 28.0, None, f"{type(e).__name__}: {e}"))

    def build_fused(params):
        opt = torch.optim.AdamW(params, fused=True, **HP)
        return opt.step

    impls.append(("torch AdamW(fused=True)", 28.0, build_fused, None))
    return impls


def _triad_gbps(n, threads, repeats):
    """STREAM triad a = b + s * c over n fp32 elements on `threads` torch threads: 12 B
    per element moved (write-allocate not counted, as STREAM does)."""
    import torch

    b, c = torch.rand(n), torch.rand(n)
    a = torch.empty(n)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - t0)
    return 12 * n / statistics.median(times[1:]) / 1e9


def bench_adam(args):
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    n = parse_count(args.params)
    impls = _adam_impls(args.threads)
    times = {name: [] for name, *_ in impls}
    errors = {name: err for name, _, _, err in impls if err}
    triad = []
    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    print(f"# {n:,} params, {args.threads} threads, {args.rounds} rounds x {args.steps} timed "
          f"steps (after {args.warmup} warm-up) per implementation, on {cpu_model()}", flush=True)
    for r in range(args.rounds):
        triad.append(_triad_gbps(n, args.threads, 3))
        for name, _, build, err in impls:
            if err:
                continue
            p = torch.nn.Parameter(torch.randn(n, generator=gen))
            p.grad = torch.randn(n, generator=gen) * 1e-2
            try:
                step = build([p])
                for i in range(args.warmup + args.steps):
                    t0 = time.perf_counter()
                    step()
                    dt = time.perf_counter() - t0
                    if i >= args.warmup:
                        times[name].append(dt)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
            del p, step
            gc.collect()
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    results = []
    for name, bpp, _, _ in impls:
        if name in errors:
            results.append(dict(impl=name, error=errors[name]))
            continue
        med = statistics.median(times[name])
        results.append(dict(impl=name, median_s=med, params_per_s=n / med,
                            bytes_per_param=bpp, gbytes_per_s=bpp * n / med / 1e9,
                            times_s=times[name]))
    load_after = os.getloadavg()
    ds = next((r for r in results if r["impl"].startswith("DeepSpeed") and "error" not in r), None)
    triad_med = statistics.median(triad)
    print()
    print(f"| implementation | ms/step (median) | G params/s | GB/s moved | vs DeepSpeedCPUAdam |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['impl']} | not run: {r['error'][:80]} | | | |")
            continue
        ratio = f"{r['params_per_s'] / ds['params_per_s']:.2f}x" if ds else "peer not run"
        r["vs_deepspeed"] = r["params_per_s"] / ds["params_per_s"] if ds else None
        print(f"| {r['impl']} | {r['median_s'] * 1e3:.1f} | {r['params_per_s'] / 1e9:.3f} | "
              f"{r['gbytes_per_s']:.1f} | {ratio} |")
    print(f"\nmemory limit (triad, {args.threads} threads): {triad_med:.1f} GB/s")
    # The machine's other work changes every figure here: say how busy it was.
    print(f"load average (1, 5, 15 min): {_load_text(load_before)} before, "
          f"{_load_text(load_after)} after")
    from strata import _native

    out = dict(bench="adam", cpu=cpu_model(), isa=_native.isa(), cores=os.cpu_count(),
               threads=args.threads,
               params=n, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
               hyper=dict(HP, betas=list(HP["betas"])), triad_gbytes_per_s=triad_med,
               triad_runs=triad, load_average_before=list(load_before),
               load_average_after=list(load_after), results=results, versions=_versions())
    _write(args.json, out)
    return out


def _load_text(load):
    return " ".join(f"{x:.2f}" for x in load)


# ---------------------------------------------------------------------------------------
# io


def bench_io(args):
    import torch

    from strata.io import Store, parse_size

    size = parse_size(args.size)
    block = parse_size(args.block)
    folder = args.path or "/var/tmp"
    work = tempfile.mkdtemp(prefix="strata-bench-io-", dir=folder)
    print(f"# {size:,} bytes, block {block:,}, queue depth {args.qd}, {args.rounds} rounds, "
          f"in {work} on {cpu_model()}", flush=True)
    results = {}
    errors = {}

    def record(name, op, seconds):
        results.setdefault(name, {}).setdefault(op, []).append(size / seconds / 1e9)

    stores = {}
    for checksums in (True, False):
        d = os.path.join(work, f"strata-{'crc' if checksums else 'nocrc'}")
        os.mkdir(d)
        stores[checksums] = Store(d, size + (16 << 20), queue_depth=args.qd, block_size=block,
                                  checksums=checksums)
    sbuf = stores[True].pinned_empty(size, torch.uint8)
    sbuf.copy_(torch.randint(0, 255, (size,), dtype=torch.uint8))
    sbuf2 = stores[False].pinned_empty(size, torch.uint8)
    sbuf2.copy_(sbuf)

    ds = None
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        handle = AsyncIOBuilder().load().aio_handle(block, args.qd, False, True, 1)
        dbuf = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        dbuf.copy_(sbuf)
        dfile = os.path.join(work, "deepnvme.bin")
        ds = (handle, dbuf, dfile)
    except Exception as e:
        errors["DeepNVMe aio_handle"] = f"{type(e).__name__}: {e}"

    for r in range(args.rounds + 1):  # round 0 warms up and is not recorded
        for checksums, buf in ((True, sbuf), (False, sbuf2)):
            name = f"strata.io (checksums {'on' if checksums else 'off'})"
            store = stores[checksums]
            t0 = time.perf_counter()
            store.write("t", buf).wait()
            t1 = time.perf_counter()
            store.read("t", buf).wait()
            t2 = time.perf_counter()
            if r:
                record(name, "write", t1 - t0)
                record(name, "read", t2 - t1)
        if ds:
            handle, dbuf, dfile = ds
            t0 = time.perf_counter()
            assert handle.pwrite(dbuf, dfile, False, True) != -1
            handle.wait()
            t1 = time.perf_counter()
            assert handle.pread(dbuf, dfile, False, True) != -1
            handle.wait()
            t2 = time.perf_counter()
            if r:
                record("DeepNVMe aio_handle", "write", t1 - t0)
                record("DeepNVMe aio_handle", "read", t2 - t1)
    assert torch.equal(sbuf, sbuf2), "strata.io read back other bytes than it wrote"
    backend = stores[True].backend
    fixed, plain = stores[True].io_counters()
    for s in stores.values():
        s.close()
    if ds:
        handle.free_cpu_locked_tensor(ds[1])
        os.remove(ds[2])
    rows = []
    peer = results.get("DeepNVMe aio_handle")
    print()
    print("| implementation | write GB/s | read GB/s | write vs aio_handle | read vs aio_handle |")
    print("|---|---|---|---|---|")
    for name, ops in results.items():
        row = dict(impl=name, write_gbytes_per_s=statistics.median(ops["write"]),
                   read_gbytes_per_s=statistics.median(ops["read"]), runs=ops)
        if peer:
            row["write_vs_aio"] = row["write_gbytes_per_s"] / statistics.median(peer["write"])
            row["read_vs_aio"] = row["read_gbytes_per_s"] / statistics.median(peer["read"])
        rows.append(row)
        rw = f"{row['write_vs_aio']:.2f}x" if peer else "peer not run"
        rr = f"{row['read_vs_aio']:.2f}x" if peer else "peer not run"
        print(f"| {name} | {row['write_gbytes_per_s']:.2f} | {row['read_gbytes_per_s']:.2f} | "
              f"{rw} | {rr} |")
    for name, err in errors.items():
        rows.append(dict(impl=name, error=err))
        print(f"| {name} | not run: {err[:80]} | | | |")
    print(f"\nstrata backend {backend}; chunks through registered buffers {fixed} of {fixed + plain}")
    out = dict(bench="io", cpu=cpu_model(), cores=os.cpu_count(), path=work,
               size_bytes=size, block_bytes=block, queue_depth=args.qd, rounds=args.rounds,
               strata_backend=backend, fixed_chunks=fixed, plain_chunks=plain,
               results=rows, versions=_versions())
    try:
        os.rmdir(work)
    except OSError:
        pass
    _write(args.json, out)
    return out


def _versions():
    v = dict(python=platform.python_version())
    for mod in ("strata", "torch", "deepspeed", "numpy"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            pass
    return v


def _write(path, data):
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"# wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m strata.bench", description=__doc__)
    sub = ap.add_subparsers(dest="bench", required=True)
    a = sub.add_parser("adam", help="CPUAdamW against DeepSpeedCPUAdam and torch fused AdamW")
    a.add_argument("--params", default="64M", help="parameters (K/M/G = 2^10/2^20/2^30)")
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--steps", type=int, default=5, help="timed steps per round")
    a.add_argument("--warmup", type=int, default=2)
    a.add_argument("--json", help="write the results here")
    i = sub.add_parser("io", help="strata.io against DeepNVMe's aio_handle")
    i.add_argument("--path", help="folder on the drive to test (default /var/tmp)")
    i.add_argument("--size", default="1GiB")
    i.add_argument("--block", default="1MiB")
    i.add_argument("--qd", type=int, default=32)
    i.add_argument("--rounds", type=int, default=5)
    i.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.bench == "adam":
        bench_adam(args)
    else:
        bench_io(args)


if __name__ == "__main__":
    sys.exit(main())
