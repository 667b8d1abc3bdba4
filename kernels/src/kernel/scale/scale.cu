// Gradients in place in f32: scaled, x *= factor (a loss scale undone, a clipping factor
// applied), and rounded to bf16's precision. One operation per element, as the CPU makes
// it, so both give the same bits. One thread per element.

// x: (N) f32 *= factor.
extern "C" __global__ void scale_f32(float* x, float factor, long long n) {
    long long i = global_index();
    if (i < n) {
        x[i] = x[i] * factor;
    }
}

// x: (N) f32 rounded to the nearest bf16 value, ties to even, kept as f32; a NaN stays a
// NaN with its quiet bit set (the CPU's rule, ops/cast.rs).
extern "C" __global__ void round_bf16_f32(float* x, long long n) {
    long long i = global_index();
    if (i < n) {
        unsigned int bits = __float_as_uint(x[i]);
        unsigned int out;
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            out = (bits | 0x00400000u) & 0xffff0000u;
        } else {
            out = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
        }
        x[i] = __uint_as_float(out);
    }
}
