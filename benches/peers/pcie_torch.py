# The PyTorch peer of `strata bench pcie`, embedded in the binary (include_str!) and run
# as `python3 -c <this> SIZE:REPEATS,...`. For each size it times pinned host-to-device
# and device-to-host copies the way PyTorch users make them (a pinned tensor copied with
# non_blocking=True) with CUDA events, and prints one JSON object on stdout:
#   {"torch": version, "device": name, "points": [{"direction": "h2d"|"d2h",
#    "size_bytes": n, "repeats": n, "median_s": seconds}, ...]}
# Exit status 2 with a one-line reason on stderr when torch or a GPU is missing.
import json
import statistics
import sys

try:
    import torch
except Exception as e:  # ImportError, or a broken install
    print(f"cannot import torch: {e}", file=sys.stderr)
    sys.exit(2)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA GPU", file=sys.stderr)
    sys.exit(2)

WARMUP = 2
plan = [tuple(int(x) for x in item.split(":")) for item in sys.argv[1].split(",")]
largest = max(size for size, _ in plan)
host_src = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
host_src.fill_(1)
host_dst = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
device_buf = torch.empty(largest, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()

points = []
for size, repeats in plan:
    for direction in ("h2d", "d2h"):
        if direction == "h2d":
            src, dst = host_src[:size], device_buf[:size]
        else:
            src, dst = device_buf[:size], host_dst[:size]
        times = []
        for i in range(WARMUP + repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= WARMUP:
                times.append(start.elapsed_time(end) / 1e3)
        points.append(
            {
                "direction": direction,
                "size_bytes": size,
                "repeats": repeats,
                "median_s": statistics.median(times),
            }
        )

print(
    json.dumps(
        {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "points": points,
        }
    )
)
