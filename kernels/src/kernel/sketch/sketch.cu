// The sketch of randomized weight gradients: S (rows x k) of +-1/sqrt(k), each sign one bit
// of a counter-based hash of (seed, row, column), as the CPU makes it (sketch/cpu.rs,
// sketch_sign), so both hold the same S. One thread per element.

// s: (rows, k) f32 = sketch_sign(seed, r, c) * scale.
extern "C" __global__ void fill_sketch(float* s, long long rows, long long k,
                                       long long seed, float scale) {
    long long i = global_index();
    if (i >= rows * k) {
        return;
    }
    unsigned long long row = (unsigned long long)(i / k);
    unsigned long long col = (unsigned long long)(i % k);
    unsigned long long position = (row << 32) | (col & 0xffffffffull);
    unsigned long long z = ((unsigned long long)seed + 0x9e3779b97f4a7c15ull) * ((position + 1ull) | 1ull);
    z ^= position;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    s[i] = (z >> 63) ? -scale : scale;
}
