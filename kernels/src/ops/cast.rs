//! Casts between f32 and the 16-bit float formats, multithreaded.
//!
//! bf16 is plain bit arithmetic, which the compiler vectorises for every [`Isa`]. fp16
//! uses the F16C conversion instructions on x86-64 with AVX2 or AVX-512, and the `half`
//! crate's software conversion on the portable path. All round to nearest, ties to even.

use half::{bf16, f16};

use super::simd::{self, on_isa};
use super::{Cpu, par_chunks};
use crate::isa::Isa;

/// One f32 to bf16 bits, branch-free so that loops over it vectorise.
#[inline(always)]
fn to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    // NaN: keep the sign and top payload bits and set the quiet bit, so rounding cannot
    // turn it into infinity.
    let quiet_nan = (bits >> 16) | 0x0040;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// out: (N)  inp: (N).
pub fn f32_to_bf16(cpu: &Cpu, out: &mut [bf16], inp: &[f32]) {
    assert_eq!(inp.len(), out.len());
    par_chunks(cpu, out, simd::LANES, |r, out| {
        on_isa!(cpu.isa, {
            for (o, &x) in out.iter_mut().zip(&inp[r]) {
                *o = bf16::from_bits(to_bf16_bits(x));
            }
        })
    });
}

/// x: (N) rounded in place to the nearest bf16 value (ties to even), kept as f32: the
/// bits [`f32_to_bf16`] then [`bf16_to_f32`] give, without a bf16 buffer.
pub fn round_to_bf16(cpu: &Cpu, x: &mut [f32]) {
    par_chunks(cpu, x, simd::LANES, |_, x| {
        on_isa!(cpu.isa, {
            for v in x.iter_mut() {
                *v = f32::from_bits((to_bf16_bits(*v) as u32) << 16);
            }
        })
    });
}

/// out: (N)  inp: (N).  Exact.
pub fn bf16_to_f32(cpu: &Cpu, out: &mut [f32], inp: &[bf16]) {
    assert_eq!(inp.len(), out.len());
    par_chunks(cpu, out, simd::LANES, |r, out| {
        on_isa!(cpu.isa, {
            for (o, &x) in out.iter_mut().zip(&inp[r]) {
                *o = f32::from_bits((x.to_bits() as u32) << 16);
            }
        })
    });
}

/// out: (N)  inp: (N).  Overflow gives infinity.
pub fn f32_to_f16(cpu: &Cpu, out: &mut [f16], inp: &[f32]) {
    assert_eq!(inp.len(), out.len());
    par_chunks(cpu, out, 8, |r, out| {
        #[cfg(target_arch = "x86_64")]
        if uses_f16c(cpu.isa) {
            // SAFETY: the CPU has F16C (checked by `uses_f16c`); lengths are equal.
            unsafe { f16c::f32_to_f16(out, &inp[r]) };
            return;
        }
        for (o, &x) in out.iter_mut().zip(&inp[r]) {
            *o = f16::from_f32(x);
        }
    });
}

/// out: (N)  inp: (N).  Exact.
pub fn f16_to_f32(cpu: &Cpu, out: &mut [f32], inp: &[f16]) {
    assert_eq!(inp.len(), out.len());
    par_chunks(cpu, out, 8, |r, out| {
        #[cfg(target_arch = "x86_64")]
        if uses_f16c(cpu.isa) {
            // SAFETY: the CPU has F16C (checked by `uses_f16c`); lengths are equal.
            unsafe { f16c::f16_to_f32(out, &inp[r]) };
            return;
        }
        for (o, &x) in out.iter_mut().zip(&inp[r]) {
            *o = x.to_f32();
        }
    });
}

/// Whether the fp16 casts use the F16C instructions under `isa` (asserting that this
/// CPU has them when `isa` promises them).
#[cfg(target_arch = "x86_64")]
fn uses_f16c(isa: Isa) -> bool {
    match isa {
        Isa::Portable => false,
        Isa::Avx2 | Isa::Avx512 => {
            assert!(isa.is_supported(), "this CPU lacks {isa}");
            true
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_cvtph_ps,
        _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
    };

    use half::f16;

    /// # Safety
    /// The CPU must support AVX and F16C. `out` and `inp` have equal lengths.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f32_to_f16(out: &mut [f16], inp: &[f32]) {
        assert_eq!(out.len(), inp.len());
        let body = inp.len() - inp.len() % 8;
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= body <= len for both slices; unaligned loads and stores;
            // f16 is 16 bits, so 8 of them are one 128-bit store.
            unsafe {
                let v = _mm256_loadu_ps(inp.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), h);
            }
        }
        for i in body..inp.len() {
            out[i] = f16::from_f32(inp[i]);
        }
    }

    /// # Safety
    /// The CPU must support AVX and F16C. `out` and `inp` have equal lengths.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_to_f32(out: &mut [f32], inp: &[f16]) {
        assert_eq!(out.len(), inp.len());
        let body = inp.len() - inp.len() % 8;
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= body <= len for both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(inp.as_ptr().add(i).cast());
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for i in body..inp.len() {
            out[i] = inp[i].to_f32();
        }
    }
}
