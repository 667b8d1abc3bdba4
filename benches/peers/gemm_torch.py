# The PyTorch peer of `strata bench gemm`, embedded in the binary (include_str!) and run
# as `PYTHON -c <this> SPEC`, where SPEC is a JSON object:
#   {"threads": n, "repeats": n, "shapes": [{"name": s, "batch": b, "m": m, "n": n,
#    "k": k, "lhs_transposed": bool, "rhs_transposed": bool, "accumulate": bool}, ...]}
# For each shape it builds the operands in the same layouts as strata's run (an operand
# marked transposed is stored transposed and passed as a transposed view, as a model's
# weight read as W^T is), times `repeats` products after one untimed, on `threads`
# threads, and prints one JSON object on stdout:
#   {"torch": version, "threads": n, "results": [{"name": s, "times_s": [...]}, ...]}
# Exit status 2 with a one-line reason on stderr when torch is missing.
import json
import sys
import time

try:
    import torch
except Exception as e:  # ImportError, or a broken install
    print(f"cannot import torch: {e}", file=sys.stderr)
    sys.exit(2)

spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
torch.manual_seed(0)


def operand(batch, rows, cols, transposed):
    """A (batch, rows, cols) operand, stored transposed when asked."""
    if transposed:
        return torch.rand(batch, cols, rows).sub_(0.5).transpose(1, 2)
    return torch.rand(batch, rows, cols).sub_(0.5)


results = []
with torch.inference_mode():
    for shape in spec["shapes"]:
        b, m, n, k = shape["batch"], shape["m"], shape["n"], shape["k"]
        lhs = operand(b, m, k, shape["lhs_transposed"])
        rhs = operand(b, k, n, shape["rhs_transposed"])
        out = torch.rand(b, m, n).sub_(0.5)
        if b == 1:
            lhs, rhs, out = lhs[0], rhs[0], out[0]

        def product():
            if shape["accumulate"]:
                if b == 1:
                    out.addmm_(lhs, rhs)
                else:
                    out.baddbmm_(lhs, rhs)
            elif b == 1:
                torch.mm(lhs, rhs, out=out)
            else:
                torch.bmm(lhs, rhs, out=out)

        product()
        times = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        results.append({"name": shape["name"], "times_s": times})
        del lhs, rhs, out

print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}))
