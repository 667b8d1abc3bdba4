//! The matrix product allocates nothing after the first: its pieces pack into buffers
//! of a pool the first product fills, whichever thread runs them. Alone in its process:
//! a counting global allocator sees every allocation of every thread.

use std::sync::atomic::Ordering;

use strata_kernels::isa::Isa;
use strata_kernels::ops::{Cpu, MatrixMut, MatrixRef, gemm};
use strata_kernels::parallel;

#[path = "../../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{ALLOCATIONS, COUNTING};

#[test]
fn products_after_the_first_allocate_nothing() {
    let isas = Isa::supported();
    let threads = parallel::max_threads().max(2);
    // (m, n, k, lhs transposed): a linear layer's three products at a small width,
    // attention-sized ones, one split over m, and k larger than a block.
    let shapes = [
        (128, 768, 256, false),
        (256, 128, 768, false),
        (256, 768, 128, true),
        (64, 128, 64, false),
        (1000, 24, 300, true),
        (33, 1500, 700, false),
    ];
    let largest = shapes
        .iter()
        .map(|&(m, n, k, _)| m * n + m * k + k * n)
        .max();
    let mut memory = vec![0.5f32; 3 * largest.unwrap()];
    let run = |memory: &mut [f32], cpu: &Cpu| {
        for &(m, n, k, lhs_transposed) in &shapes {
            let (dst, operands) = memory.split_at_mut(m * n);
            let (lhs, rhs) = operands.split_at(m * k);
            let lhs = if lhs_transposed {
                MatrixRef::row_major(&lhs[..m * k], k, m).transposed()
            } else {
                MatrixRef::row_major(&lhs[..m * k], m, k)
            };
            let rhs = MatrixRef::row_major(&rhs[..k * n], k, n);
            gemm(cpu, MatrixMut::row_major(dst, m, n), lhs, rhs, 0.5, true);
        }
    };
    // The first product fills the pool of packing buffers.
    for &isa in &isas {
        run(&mut memory, &Cpu { isa, threads });
        run(&mut memory, &Cpu::single(isa));
    }
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        for &isa in &isas {
            run(&mut memory, &Cpu::single(isa));
            run(&mut memory, &Cpu { isa, threads });
        }
    }
    COUNTING.store(false, Ordering::SeqCst);
    assert_eq!(
        ALLOCATIONS.load(Ordering::SeqCst),
        0,
        "allocations during products"
    );
    assert!(memory.iter().all(|x| x.is_finite()));
}
