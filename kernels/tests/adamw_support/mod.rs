//! What the AdamW test files share: a seeded pseudo-random stream. A folder module, so
//! that cargo does not build it as a test of its own.

// Each test file uses a different part of it.
#![allow(dead_code)]

/// A deterministic stream of pseudo-random numbers (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), on a grid of 2^-24.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    pub fn signed(&mut self) -> f32 {
        self.uniform() * 2.0 - 1.0
    }

    /// Approximately standard normal (sum of 12 uniforms).
    pub fn normal(&mut self) -> f32 {
        (0..12).map(|_| self.uniform()).sum::<f32>() - 6.0
    }

    /// Log-uniform magnitude over `decades` decades below `top`, random sign.
    pub fn spread(&mut self, top: f32, decades: f32) -> f32 {
        let e = (self.signed() * 0.5 + 0.5) * decades;
        let x = top * 10f32.powf(-e);
        if self.next_u64() & 1 == 0 { x } else { -x }
    }
}
