//! Which instruction set the CPU kernels use, chosen once per process.
//!
//! Every SIMD kernel has one implementation per [`Isa`]; the portable one is always
//! compiled and serves every CPU. [`Isa::active`] picks the best the CPU supports, once.
//! `STRATA_ISA=avx512|avx2|portable` asks for a lower one (for comparisons); asking for
//! one the CPU lacks falls back to the best supported, with a warning. Tests run every
//! path the machine has by passing an explicit [`Isa`] from [`Isa::supported`].

use std::sync::OnceLock;

/// An instruction set a CPU kernel can be built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust the compiler may vectorise for the baseline target; runs everywhere.
    Portable,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 Foundation (with AVX2, FMA and F16C, which every such CPU has).
    Avx512,
}

impl Isa {
    /// Every instruction set, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The name used in `STRATA_ISA`, logs and benchmark reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The instruction set `name` (as in `STRATA_ISA`, surrounding blanks ignored) names.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name() == name.trim())
    }

    /// Whether the AdamW kernels of `self` fuse multiply-adds (one rounding): AVX2's and
    /// AVX-512's do, the portable kernel does not. The CUDA AdamW follows this process's
    /// choice, so the GPU and the CPU optimizer compute the same bits.
    pub fn fuses_multiply_add(self) -> bool {
        self != Isa::Portable
    }

    /// Whether this CPU can run kernels built for `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_supported() && std::arch::is_x86_feature_detected!("avx512f")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU supports, lowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The best instruction set this CPU supports.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.is_supported())
            .unwrap_or(Isa::Portable)
    }

    /// The instruction set the kernels use in this process: [`Isa::best`], or the one
    /// `STRATA_ISA` names if the CPU supports it. Decided on first call.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = Isa::best();
            let Ok(wanted) = std::env::var("STRATA_ISA") else {
                return best;
            };
            match Isa::from_name(&wanted) {
                Some(isa) if isa.is_supported() => isa,
                Some(isa) => {
                    log::warn!(
                        "STRATA_ISA={} is not supported by this CPU; using {}",
                        isa.name(),
                        best.name()
                    );
                    best
                }
                None => {
                    log::warn!(
                        "STRATA_ISA={wanted} is not one of portable, avx2, avx512; using {}",
                        best.name()
                    );
                    best
                }
            }
        })
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_always_supported_and_best_is_supported() {
        assert!(Isa::Portable.is_supported());
        assert!(Isa::best().is_supported());
        assert!(Isa::supported().contains(&Isa::best()));
        assert!(Isa::active().is_supported());
    }

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name(" avx2\n"), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("neon"), None);
    }
}
