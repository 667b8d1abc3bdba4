// Softmax cross-entropy over the vocabulary. One block per row (position).

// The maximum of a row of v logits, and the sum of exp(logit - maximum), to every thread
// of the block.
template <typename T>
__device__ float2 row_max_and_exp_sum(const T* l, int v, float* shared) {
    float m = NEG_INF;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        m = fmaxf(m, to_float(l[j]));
    }
    m = block_max(m, shared);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        s += expf(to_float(l[j]) - m);
    }
    return make_float2(m, block_sum(s, shared));
}

// The target id the loss does not count (program::IGNORE_TARGET): loss 0, gradient 0.
#define IGNORE_TARGET 0xffffffffu

// losses: (N)  logits: (N, V)  targets: (N). A target outside 0..V gives a NaN loss
// rather than a read outside the row; IGNORE_TARGET gives 0.
template <typename T>
__device__ void crossentropy_forward(float* losses, const T* logits,
                                     const unsigned int* targets, int v) {
    __shared__ float shared[32];
    const T* l = logits + (long long)blockIdx.x * v;
    float2 ms = row_max_and_exp_sum(l, v, shared);
    float m = ms.x;
    float s = ms.y;
    if (threadIdx.x == 0) {
        unsigned int target = targets[blockIdx.x];
        float picked = target < (unsigned int)v ? to_float(l[target]) : __int_as_float(0x7fc00000);
        losses[blockIdx.x] = target == IGNORE_TARGET ? 0.0f : logf(s) + m - picked;
    }
}

// logits: (N, V) replaced in place by (softmax - onehot(targets)) * dloss; a row whose
// target is IGNORE_TARGET by zeros.
template <typename T>
__device__ void crossentropy_backward(T* logits, const unsigned int* targets, float dloss,
                                      int v) {
    __shared__ float shared[32];
    T* l = logits + (long long)blockIdx.x * v;
    unsigned int target = targets[blockIdx.x];
    if (target == IGNORE_TARGET) {
        // The whole block takes this branch (one row per block), so no thread waits at
        // a barrier the others skip.
        for (int j = threadIdx.x; j < v; j += blockDim.x) {
            l[j] = from_float<T>(0.0f);
        }
        return;
    }
    float2 ms = row_max_and_exp_sum(l, v, shared);
    float m = ms.x;
    float scale = dloss / ms.y;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float g = expf(to_float(l[j]) - m) * scale;
        if ((unsigned int)j == target) {
            g -= dloss;
        }
        l[j] = from_float<T>(g);
    }
}

#define CROSSENTROPY_KERNELS(T, S)                                                            \
    extern "C" __global__ void crossentropy_forward_##S(float* losses, const T* logits,       \
                                                        const unsigned int* targets, int v) { \
        crossentropy_forward<T>(losses, logits, targets, v);                                  \
    }                                                                                         \
    extern "C" __global__ void crossentropy_backward_##S(T* logits,                           \
                                                         const unsigned int* targets,         \
                                                         float dloss, int v) {                \
        crossentropy_backward<T>(logits, targets, dloss, v);                                  \
    }
FOR_EACH_TYPE(CROSSENTROPY_KERNELS)
