// The optimizer on the GPU: one AdamW step over one tensor, and the gradient statistics
// (sum of squares, non-finite flag) that clipping and fp16 loss scaling need.
//
// Both follow the CPU reference (kernels/src/reference/adamw.rs) operation by operation,
// written with the round-to-nearest intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn,
// __fsqrt_rn, __dmul_rn, __dadd_rn), which the compiler never contracts into fused
// multiply-adds: the reference computes each product and sum rounded on its own, and so
// does this file. The step's results should be the reference's bit for bit (IEEE square
// root and division, no flush of subnormals); the statistics' sum differs from the CPU's
// only in its order of addition. Both repeat bit for bit from run to run (no atomics; the
// statistics are a fixed two-pass reduction).

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
    // sqrt(1 - beta2^t).
    float bias_correction2_sqrt;
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

// params, m, v, grads: (N) f32; copy_out: (N) of the type `copy_mode` names, or unused.
// One thread per element, in torch's order of operations as the reference writes it:
//   g = grad * grad_scale
//   p = p * decay
//   m = m + (1 - beta1) * (g - m)
//   v = v * beta2 + (1 - beta2) * g * g
//   p = p + (-step_size) * m / (sqrt(v) / bias_correction2_sqrt + eps)
extern "C" __global__ void adamw_step(float* params, float* m, float* v, const float* grads,
                                      void* copy_out, int copy_mode, AdamConstants k,
                                      long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float g = __fmul_rn(grads[i], k.grad_scale);
    float p = __fmul_rn(params[i], k.decay);
    float mi = m[i];
    mi = __fadd_rn(mi, __fmul_rn(k.one_minus_beta1, __fsub_rn(g, mi)));
    float vi = __fadd_rn(__fmul_rn(v[i], k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bias_correction2_sqrt), k.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(-k.step_size, mi), denom));
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

// Threads per block of both statistics kernels (a power of two; the host's
// GRAD_STATS_THREADS in kernel/optimizer/mod.rs). Launches must use exactly this many.
#define GRAD_STATS_THREADS 256

// Sums the GRAD_STATS_THREADS values of `shared` into shared[0], pairwise in a fixed
// order. Every thread of the block calls it.
__device__ void block_sum_f64_fixed(double* shared) {
    __syncthreads();
    for (int stride = GRAD_STATS_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            shared[threadIdx.x] = __dadd_rn(shared[threadIdx.x], shared[threadIdx.x + stride]);
        }
        __syncthreads();
    }
}

// partials: (gridDim.x) f64  grads: (N) f32. Pass one of the statistics: block b writes
// the sum of (grads[i] * scale)^2 over the elements i its threads visit (thread j of block
// b: i = b * GRAD_STATS_THREADS + j, then every gridDim.x * GRAD_STATS_THREADS further).
// The product is rounded to f32 as the step rounds it; its square is exact in f64.
extern "C" __global__ void grad_stats_partials(double* partials, const float* grads,
                                               float scale, long long n) {
    __shared__ double shared[GRAD_STATS_THREADS];
    double acc = 0.0;
    long long stride = (long long)gridDim.x * GRAD_STATS_THREADS;
    for (long long i = (long long)blockIdx.x * GRAD_STATS_THREADS + threadIdx.x; i < n;
         i += stride) {
        double g = (double)__fmul_rn(grads[i], scale);
        acc = __dadd_rn(acc, __dmul_rn(g, g));
    }
    shared[threadIdx.x] = acc;
    block_sum_f64_fixed(shared);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = shared[0];
    }
}

// out: two f64 (the sum, then 1.0 if it is not finite, else 0.0)  partials: (count) f64.
// Pass two, one block: thread j adds partials j, j + GRAD_STATS_THREADS, ... in order,
// then the block sums the threads' totals pairwise. A sum of squares of finite f32 values
// cannot overflow f64, so the sum is non-finite exactly when some scaled gradient is.
extern "C" __global__ void grad_stats_total(double* out, const double* partials, int count) {
    __shared__ double shared[GRAD_STATS_THREADS];
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += GRAD_STATS_THREADS) {
        acc = __dadd_rn(acc, partials[i]);
    }
    shared[threadIdx.x] = acc;
    block_sum_f64_fixed(shared);
    if (threadIdx.x == 0) {
        double total = shared[0];
        long long exponent = __double_as_longlong(total) & 0x7ff0000000000000LL;
        out[0] = total;
        out[1] = exponent == 0x7ff0000000000000LL ? 1.0 : 0.0;
    }
}
