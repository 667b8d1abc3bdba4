// The optimizer on the GPU: one AdamW step over one tensor, and the gradient statistics
// (sum of squares, non-finite flag) that clipping and fp16 loss scaling need.
//
// Both compute what the CPU optimizer of this process computes, bit for bit, so that a
// policy that updates on the GPU (all-on-device) trains the same model as one that
// updates on the CPU (invariant 1):
// - the step follows the CPU kernels' order of operations (kernels/src/adamw, and its
//   reference `update_kernel_order` in kernels/src/reference/adamw.rs), with fused
//   multiply-adds where the CPU's AVX2 and AVX-512 kernels fuse them (`fused`: one
//   rounding, __fmaf_rn) and separate roundings where the portable kernel does not. Every
//   operation is written with a round-to-nearest intrinsic (__fmul_rn, __fadd_rn,
//   __fdiv_rn, __fsqrt_rn, __fmaf_rn), which the compiler never contracts or reorders;
//   IEEE square root and division, no flush of subnormals.
// - the statistics sum in the CPU's order (STATS_PIECE and STATS_LANES in
//   kernels/src/adamw/mod.rs): pieces of STATS_PIECE elements, each the pairwise sum of
//   STATS_LANES lane sums, folded left in order from zero.
// Both repeat bit for bit from run to run (no atomics).

// The constants of one AdamW step (crate::adamw::AdamStep), passed by value. The host
// mirror is `AdamConstants` in kernels/src/cuda/launch.rs: nine f32, in this order.
struct AdamConstants {
    float grad_scale;
    // 1 - lr * weight_decay (1 without decay).
    float decay;
    float beta1;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    // lr / (1 - beta1^t).
    float step_size;
    // 1 / sqrt(1 - beta2^t).
    float inv_bias_correction2_sqrt;
    float eps;
};

// What adamw_step writes to `copy_out` (the host's `CopyMode` in mod.rs): nothing, the
// new parameters as bf16 or f16, or as f32 exactly, or rounded to bf16 or f16 and held
// as f32.
#define COPY_NONE 0
#define COPY_BF16 1
#define COPY_F16 2
#define COPY_F32 3
#define COPY_F32_AS_BF16 4
#define COPY_F32_AS_F16 5

// a * b + c as the CPU kernels round it: once when `fused`, else the product, then the sum.
__device__ __forceinline__ float mul_add(float a, float b, float c, int fused) {
    return fused ? __fmaf_rn(a, b, c) : __fadd_rn(__fmul_rn(a, b), c);
}

// params, m, v, grads: (N) f32; copy_out: (N) of the type `copy_mode` names, or unused.
// One thread per element, in the CPU kernels' order of operations (mul_add: fused when
// `fused` is 1, as the AVX2 and AVX-512 kernels are, unfused when 0, as the portable one):
//   g = grad * grad_scale
//   m = mul_add(beta1, m, (1 - beta1) * g)
//   v = mul_add(beta2, v, ((1 - beta2) * g) * g)
//   denom = mul_add(sqrt(v), inv_bias_correction2_sqrt, eps)
//   p = mul_add(-step_size, m / denom, p * decay)
extern "C" __global__ void adamw_step(float* params, float* m, float* v, const float* grads,
                                      void* copy_out, int copy_mode, int fused,
                                      AdamConstants k, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float g = __fmul_rn(grads[i], k.grad_scale);
    float mi = mul_add(k.beta1, m[i], __fmul_rn(k.one_minus_beta1, g), fused);
    float g2 = __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g);
    float vi = mul_add(k.beta2, v[i], g2, fused);
    float denom = mul_add(__fsqrt_rn(vi), k.inv_bias_correction2_sqrt, k.eps, fused);
    float p = mul_add(-k.step_size, __fdiv_rn(mi, denom), __fmul_rn(params[i], k.decay), fused);
    params[i] = p;
    m[i] = mi;
    v[i] = vi;
    switch (copy_mode) {
    case COPY_BF16:
        ((bf16*)copy_out)[i] = from_float<bf16>(p);
        break;
    case COPY_F16:
        ((f16*)copy_out)[i] = from_float<f16>(p);
        break;
    case COPY_F32:
        ((float*)copy_out)[i] = p;
        break;
    case COPY_F32_AS_BF16:
        ((float*)copy_out)[i] = to_float(from_float<bf16>(p));
        break;
    case COPY_F32_AS_F16:
        ((float*)copy_out)[i] = to_float(from_float<f16>(p));
        break;
    default:
        break;
    }
}

// Threads per block of both statistics kernels (a multiple of STATS_LANES; the host's
// GRAD_STATS_THREADS in kernel/optimizer/mod.rs). Launches must use exactly this many.
#define GRAD_STATS_THREADS 256
// The CPU's piece and lanes (STATS_PIECE, STATS_LANES in kernels/src/adamw/mod.rs).
#define STATS_PIECE 16384
#define STATS_LANES 16
#define PIECES_PER_BLOCK (GRAD_STATS_THREADS / STATS_LANES)

// partials: (ceil(N / STATS_PIECE)) f64  grads: (N) f32. Pass one: each piece's sum of
// (grads[i] * scale)^2, as the CPU sums a piece. Thread t of block b is lane
// t % STATS_LANES of piece b * PIECES_PER_BLOCK + t / STATS_LANES: it adds, in order from
// zero, the squares of the piece's elements lane, lane + STATS_LANES, ... (the product
// rounded to f32 as the step rounds it; its square is exact in f64, so adding it is
// the CPU's fused multiply-add); then the piece's lanes are summed pairwise, adjacent
// lanes first, as `pairwise` in kernels/src/adamw/portable.rs.
extern "C" __global__ void grad_stats_partials(double* partials, const float* grads,
                                               float scale, long long n) {
    __shared__ double shared[GRAD_STATS_THREADS];
    int lane = threadIdx.x % STATS_LANES;
    long long piece = (long long)blockIdx.x * PIECES_PER_BLOCK + threadIdx.x / STATS_LANES;
    long long start = piece * STATS_PIECE;
    long long end = min(start + STATS_PIECE, n);
    double acc = 0.0;
    for (long long i = start + lane; i < end; i += STATS_LANES) {
        double g = (double)__fmul_rn(grads[i], scale);
        acc = __dadd_rn(acc, __dmul_rn(g, g));
    }
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (int width = 2; width <= STATS_LANES; width <<= 1) {
        if (lane % width == 0) {
            shared[threadIdx.x] = __dadd_rn(shared[threadIdx.x], shared[threadIdx.x + width / 2]);
        }
        __syncthreads();
    }
    if (lane == 0 && start < n) {
        partials[piece] = shared[threadIdx.x];
    }
}

// out: two f64 (the sum, then 1.0 if it is not finite, else 0.0)  partials: (count) f64.
// Pass two, one block: the pieces' sums folded left in order from zero, as the CPU folds
// them; the block stages them through shared memory and thread 0 adds. A sum of squares
// of finite f32 values cannot overflow f64, so the sum is non-finite exactly when some
// scaled gradient is.
extern "C" __global__ void grad_stats_total(double* out, const double* partials, int count) {
    __shared__ double shared[GRAD_STATS_THREADS];
    double total = 0.0;
    for (int base = 0; base < count; base += GRAD_STATS_THREADS) {
        int i = base + threadIdx.x;
        shared[threadIdx.x] = i < count ? partials[i] : 0.0;
        __syncthreads();
        if (threadIdx.x == 0) {
            int here = min(GRAD_STATS_THREADS, count - base);
            for (int j = 0; j < here; ++j) {
                total = __dadd_rn(total, shared[j]);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        long long exponent = __double_as_longlong(total) & 0x7ff0000000000000LL;
        out[0] = total;
        out[1] = exponent == 0x7ff0000000000000LL ? 1.0 : 0.0;
    }
}
