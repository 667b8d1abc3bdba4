//! Invariant 3: no allocation on the hot path after the first step. Alone in its process:
//! a counting global allocator sees every allocation, and other tests would add theirs.
//!
//! Buffer memory (device slots, host slots, NVMe extents, pinned staging) is allocated
//! once when the executor is built. What a step may still allocate is bookkeeping: lane
//! threads' names, the report's per-operation records, small vectors inside kernels.
//! The check counts every heap allocation of 64 KiB or more (a buffer's worth) during
//! steps 2 to 5, and requires none.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::{Gpt2Config, Model};
use strata_engine::plan::{
    AllOnDevice, Budgets, CpuOffload, NvmeOffload, ParamOffload, Plan, PlanInput, Policy,
    StepShape, Tier,
};

const BIG: usize = 64 << 10;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static BIG_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static ALL_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALL_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        if COUNTING.load(Ordering::Relaxed) && layout.size() >= BIG {
            BIG_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: the caller's layout goes to the system allocator unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) && new_size >= BIG {
            BIG_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        // SAFETY: as for alloc and dealloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn steps_after_the_first_allocate_no_buffers() {
    // Wide enough that every block buffer is well over 64 KiB.
    let model = Model::new(Gpt2Config::new(2, 4, 128, 512, 64)).unwrap();
    let shape = StepShape {
        grad_accum: 2,
        needs_global_norm: true,
        ..StepShape::cpu(2, 64)
    };
    let budgets = Budgets {
        device: u64::MAX / 4,
        host: u64::MAX / 4,
        nvme: u64::MAX / 4,
    };
    let policies: Vec<Box<dyn Policy>> = vec![
        Box::new(AllOnDevice),
        Box::new(CpuOffload),
        Box::new(ParamOffload {
            depth: 2,
            checkpoints: Tier::Host,
        }),
        Box::new(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Nvme,
        }),
    ];
    let n = 2 * 64;
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7) % 512).collect();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 13 + 1) % 512).collect();
    let batches = [(&tokens[..], &targets[..]), (&targets[..], &tokens[..])];
    let params = StepParams {
        adam: AdamW::default(),
        clip: 1.0,
        loss_scale: 1.0,
    };
    for policy in policies {
        let input = PlanInput {
            model: &model,
            shape,
            budgets,
        };
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![dir.path().into()],
            ..ExecConfig::default()
        };
        let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
        exec.load(&model.init_params(1), None).unwrap();
        exec.step(&batches, &params).unwrap();
        BIG_ALLOCATIONS.store(0, Ordering::SeqCst);
        ALL_ALLOCATIONS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        for _ in 0..4 {
            exec.step(&batches, &params).unwrap();
        }
        COUNTING.store(false, Ordering::SeqCst);
        let ops = exec.plan().ops.len();
        println!(
            "{}: {} allocations of any size in 4 steps of {ops} operations",
            policy.name(),
            ALL_ALLOCATIONS.load(Ordering::SeqCst)
        );
        let count = BIG_ALLOCATIONS.load(Ordering::SeqCst);
        assert_eq!(
            count,
            0,
            "{}: {count} allocations of 64 KiB or more during steps 2-5 (largest {} bytes)",
            policy.name(),
            LARGEST.load(Ordering::SeqCst)
        );
    }
}
