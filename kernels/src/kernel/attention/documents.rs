//! Packed documents: each token's document's first position, from the token ids and the
//! id that ends a document ([`DocStarts`]), which the fused attention's mask and the
//! rotary embedding read. Its CUDA kernel is `flash_attention.cu`'s `doc_starts`.

use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, int, per_element};
use crate::ops::Cpu;
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

/// The kernel's CUDA source (the fused attention's).
const SOURCE: CudaSource = ("flash_attention.cu", include_str!("flash_attention.cu"));
/// One thread per sequence.
const DOC_STARTS: Entry = Entry::untyped("doc_starts");

/// doc_start: (B, T) u32 = for each token, the first position of its document in its
/// sequence, documents ending with the token `eos` (the token after an `eos` starts the
/// next) or with the sequence; tokens: (B, T) u32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DocStarts {
    /// (B, T) u32, written.
    pub doc_start: TensorRef,
    /// (B, T) u32 token ids.
    pub tokens: TensorRef,
    /// The id that ends a document.
    pub eos: u32,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
}

/// `doc_start` of [`DocStarts`] on the CPU: `b` rows of `tokens.len() / b` tokens.
pub fn doc_starts(doc_start: &mut [u32], tokens: &[u32], eos: u32, t: usize) {
    assert_eq!(doc_start.len(), tokens.len(), "one start per token");
    for (starts, row) in doc_start
        .chunks_exact_mut(t.max(1))
        .zip(tokens.chunks_exact(t.max(1)))
    {
        let mut start = 0;
        for (i, s) in starts.iter_mut().enumerate() {
            if i > 0 && row[i - 1] == eos {
                start = i as u32;
            }
            *s = start;
        }
    }
}

impl Signature for DocStarts {
    const NAME: &'static str = "doc-starts";
    type Shape = ();

    fn shape(&self) -> Result<(), KernelError> {
        Ok(())
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (u32_, len) = (
            DtypeRule::Exactly(Dtype::U32),
            LenRule::Len(self.b * self.t),
        );
        each(Param::write("doc_start", &self.doc_start, u32_, len));
        each(Param::read("tokens", &self.tokens, u32_, len));
    }

    fn flops(&self) -> f64 {
        0.0
    }
}

impl CpuKernel for DocStarts {
    fn run_cpu(&self, _: &(), _: &Cpu, _: &Scalars, t: &CpuTensors<'_>) -> Result<(), KernelError> {
        let doc_start = t.u32_mut(&self.doc_start);
        doc_starts(doc_start, t.u32(&self.tokens), self.eos, self.t);
        Ok(())
    }
}

impl CudaKernel for DocStarts {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[DOC_STARTS];

    fn launch(&self, _: &(), _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        if self.b * self.t == 0 {
            return Ok(());
        }
        // doc_starts(unsigned* doc_start, const unsigned* tokens, int b, int t, unsigned
        // eos): thread `bi` < B writes row bi of doc_start from row bi of tokens (T each).
        let eos = Arg::Int(i32::try_from(self.eos).expect("a token id below 2^31"));
        let args = [
            q.ptr(&self.doc_start),
            q.ptr(&self.tokens),
            int(self.b),
            int(self.t),
            eos,
        ];
        Ok(q.launch(DOC_STARTS, per_element(self.b), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{
        Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs,
    };
    use crate::kernel::Kernel;

    impl Emulated for DocStarts {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            [(2, 7), (1, 1), (0, 3)]
                .map(|(b, t)| DocStarts {
                    doc_start: l.tensor(b * t, Dtype::U32),
                    tokens: l.tensor(b * t, Dtype::U32),
                    eos: 2,
                    b,
                    t,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("b", self.b), ("t", self.t), ("eos", self.eos as usize)]
        }

        fn emulate(name: &str, args: &[Arg], m: &Emulator) -> bool {
            if name != "doc_starts" {
                return false;
            }
            let (doc_start, tokens) = (ptr_arg(name, args, 0), ptr_arg(name, args, 1));
            let (b, t, eos) = (
                count_arg(name, args, 2),
                count_arg(name, args, 3),
                count_arg(name, args, 4),
            );
            for bi in 0..b {
                let mut start = 0u32;
                for i in 0..t {
                    let at = bi * t + i;
                    if i > 0 && m.load(tokens, at - 1).to_bits() as usize == eos {
                        start = i as u32;
                    }
                    m.store(doc_start, at, f32::from_bits(start));
                }
            }
            true
        }
    }

    #[test]
    fn documents_end_after_each_end_of_text_token() {
        let tokens = [5, 2, 7, 7, 2, 2, 9, 1, 2, 3];
        let mut starts = [u32::MAX; 10];
        doc_starts(&mut starts, &tokens, 2, 5);
        // Two sequences of 5: each starts a document; an eos ends its own.
        assert_eq!(starts, [0, 0, 2, 2, 2, 0, 1, 1, 1, 4]);
    }

    #[test]
    fn the_cuda_launch_computes_what_the_cpu_computes() {
        let mut l = Layout::default();
        let kernels: Vec<Kernel> = [(2, 9), (3, 1), (1, 16)]
            .map(|(b, t)| {
                Kernel::DocStarts(DocStarts {
                    doc_start: l.tensor(b * t, Dtype::U32),
                    tokens: l.tensor(b * t, Dtype::U32),
                    eos: 3,
                    b,
                    t,
                })
            })
            .to_vec();
        let mut inputs = random_inputs(&l, &kernels, 3);
        for (i, k) in kernels.iter().enumerate() {
            if let Kernel::DocStarts(d) = k {
                let ids: Vec<u32> = (0..d.tokens.len)
                    .map(|j| ((j * 7 + i) % 5) as u32)
                    .collect();
                inputs.write_u32(&d.tokens, &ids);
            }
        }
        check_emulation(&kernels, inputs, 0.0);
    }
}
