// Scaling in place, x *= factor in f32: gradient scaling (a loss scale undone, a clipping
// factor applied). One multiply per element, as the CPU makes it, so both give the same
// bits. One thread per element.

// x: (N) f32 *= factor.
extern "C" __global__ void scale_f32(float* x, float factor, long long n) {
    long long i = global_index();
    if (i < n) {
        x[i] = x[i] * factor;
    }
}
