//! Where a device's compute time goes: the seconds each kernel took, summed by kernel
//! name ([`KernelTimes`]). The CPU device times every kernel it runs, as it runs it
//! (`CpuAccess::run_kernel`); a GPU's kernels run asynchronously on its streams and are
//! not timed one by one, so its table stays empty.
//!
//! The table is a fixed array, not a vector: every step takes it twice and reports the
//! difference, and a step allocates nothing but its report's records
//! (`engine/tests/offload_alloc.rs`).

/// One kernel's share of a device's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelTime {
    /// The kernel's name (`Kernel::name`).
    pub name: &'static str,
    /// Times it ran.
    pub calls: u64,
    /// Seconds it ran, summed over its calls, from the call's start to its end.
    pub seconds: f64,
    /// Floating-point operations of its calls (`Kernel::flops`, a multiply-add counted
    /// as two).
    pub flops: f64,
}

impl KernelTime {
    /// `name`, with nothing counted yet.
    const fn none(name: &'static str) -> Self {
        KernelTime {
            name,
            calls: 0,
            seconds: 0.0,
            flops: 0.0,
        }
    }
}

/// How many kernel names a table holds apart; past that, the rest share the last entry,
/// named [`OTHERS`]. The registry has fewer kernels than this.
pub const KERNEL_NAMES: usize = 64;

/// The name of the entry that sums the kernels past [`KERNEL_NAMES`] - 1.
pub const OTHERS: &str = "(other kernels)";

/// The seconds, calls and FLOPs of every kernel a device ran, by name, in the order
/// each first ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelTimes {
    len: usize,
    slots: [KernelTime; KERNEL_NAMES],
}

impl Default for KernelTimes {
    fn default() -> Self {
        KernelTimes {
            len: 0,
            slots: [KernelTime::none(""); KERNEL_NAMES],
        }
    }
}

impl KernelTimes {
    /// One entry per kernel name.
    pub fn entries(&self) -> &[KernelTime] {
        &self.slots[..self.len]
    }

    /// The entry of `name`, made when it is new (the shared last one when the table is
    /// full).
    fn slot(&mut self, name: &'static str) -> &mut KernelTime {
        let at = match self.entries().iter().position(|e| e.name == name) {
            Some(at) => at,
            None if self.len < KERNEL_NAMES => {
                self.slots[self.len] = KernelTime::none(name);
                self.len += 1;
                self.len - 1
            }
            None => {
                self.slots[KERNEL_NAMES - 1].name = OTHERS;
                KERNEL_NAMES - 1
            }
        };
        &mut self.slots[at]
    }

    /// Counts one call of `name` that took `seconds` and did `flops` operations.
    pub fn add(&mut self, name: &'static str, seconds: f64, flops: f64) {
        let e = self.slot(name);
        e.calls += 1;
        e.seconds += seconds;
        e.flops += flops;
    }

    /// What ran after `before` was taken from the same device: each entry less its
    /// count in `before`, without the kernels that did not run since.
    pub fn since(&self, before: &KernelTimes) -> KernelTimes {
        let mut after = KernelTimes::default();
        for e in self.entries() {
            let old = before.entries().iter().find(|o| o.name == e.name);
            let old = old.copied().unwrap_or(KernelTime::none(e.name));
            if e.calls > old.calls {
                let slot = after.slot(e.name);
                slot.calls = e.calls - old.calls;
                slot.seconds = e.seconds - old.seconds;
                slot.flops = e.flops - old.flops;
            }
        }
        after
    }

    /// Seconds of every kernel.
    pub fn seconds(&self) -> f64 {
        self.entries().iter().map(|e| e.seconds).sum()
    }

    /// The entries whose names `pick` accepts, summed as one (named `name`).
    pub fn sum_of(&self, name: &'static str, pick: impl Fn(&str) -> bool) -> KernelTime {
        let mut sum = KernelTime::none(name);
        for e in self.entries().iter().filter(|e| pick(e.name)) {
            sum.calls += e.calls;
            sum.seconds += e.seconds;
            sum.flops += e.flops;
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_keeps_only_what_ran_after() {
        let mut times = KernelTimes::default();
        times.add("matmul", 1.0, 10.0);
        times.add("gelu", 0.5, 2.0);
        let before = times;
        times.add("matmul", 2.0, 10.0);
        times.add("layernorm", 0.25, 1.0);
        let after = times.since(&before);
        let one = |name, seconds, flops| KernelTime {
            name,
            calls: 1,
            seconds,
            flops,
        };
        assert_eq!(
            after.entries(),
            [one("matmul", 2.0, 10.0), one("layernorm", 0.25, 1.0)]
        );
        assert_eq!(after.seconds(), 2.25);
        let products = times.sum_of("products", |n| n.starts_with("mat"));
        assert_eq!((products.calls, products.seconds), (2, 3.0));
    }

    #[test]
    fn names_past_the_table_share_its_last_entry() {
        let mut times = KernelTimes::default();
        for i in 0..KERNEL_NAMES + 2 {
            let name: &'static str = Box::leak(format!("kernel {i}").into_boxed_str());
            times.add(name, 1.0, 0.0);
        }
        assert_eq!(times.entries().len(), KERNEL_NAMES);
        let last = times.entries()[KERNEL_NAMES - 1];
        assert_eq!((last.name, last.calls), (OTHERS, 3));
        assert_eq!(times.seconds(), (KERNEL_NAMES + 2) as f64);
    }
}
