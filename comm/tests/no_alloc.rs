//! Collectives allocate nothing after the first call of each size: the thread group's
//! per-rank deposits and [`Solo`] are grow-only or need no memory at all. Alone in its
//! process: a counting global allocator sees every allocation of every thread.

use std::sync::Barrier;
use std::sync::atomic::Ordering;
use std::time::Duration;

use strata_comm::{Collective, Solo, ThreadGroup};

#[path = "../../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{ALLOCATIONS, COUNTING};

/// Every collective once, on buffers the caller owns.
fn every_collective(c: &dyn Collective, bytes: &mut [u8], floats: &mut [f32], values: &mut [f64]) {
    let size = c.size();
    let (send, recv) = bytes.split_at_mut(bytes.len() / (size + 1));
    c.all_gather(send, &mut recv[..size * send.len()]).unwrap();
    c.broadcast(size - 1, send).unwrap();
    let (send, acc) = floats.split_at_mut(floats.len() / (size + 1) * size);
    c.reduce_scatter_sum(send, &mut acc[..send.len() / size], true)
        .unwrap();
    c.reduce_scatter_sum(send, &mut acc[..send.len() / size], false)
        .unwrap();
    c.all_reduce_sum_f64(values).unwrap();
    c.barrier().unwrap();
}

#[test]
fn collectives_after_the_first_allocate_nothing() {
    let size = 3;
    let group = ThreadGroup::new(size, Duration::from_secs(60));
    let solo = Solo::new();
    // Main and every rank: warmed up, counting on, counted calls done.
    let warmed = Barrier::new(size + 1);
    let counting = Barrier::new(size + 1);
    let done = Barrier::new(size + 1);
    let chunk = 1000;
    std::thread::scope(|scope| {
        for rank in &group {
            let (warmed, counting, done) = (&warmed, &counting, &done);
            scope.spawn(move || {
                let mut bytes = vec![1u8; (size + 1) * chunk];
                let mut floats = vec![0.5f32; (size + 1) * chunk];
                let mut values = vec![0.25f64; chunk];
                every_collective(rank, &mut bytes, &mut floats, &mut values);
                warmed.wait();
                counting.wait();
                for _ in 0..20 {
                    every_collective(rank, &mut bytes, &mut floats, &mut values);
                }
                done.wait();
            });
        }
        let mut bytes = vec![1u8; 2 * chunk];
        let mut floats = vec![0.5f32; 2 * chunk];
        let mut values = vec![0.25f64; chunk];
        warmed.wait();
        ALLOCATIONS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        counting.wait();
        for _ in 0..20 {
            every_collective(&solo, &mut bytes, &mut floats, &mut values);
        }
        done.wait();
        COUNTING.store(false, Ordering::SeqCst);
    });
    assert_eq!(
        ALLOCATIONS.load(Ordering::SeqCst),
        0,
        "allocations after warm-up"
    );
}
