//! Where a device's compute time goes: the seconds each kernel took, summed by kernel
//! name ([`KernelTimes`]). The CPU device times every kernel it runs, as it runs it
//! (`CpuAccess::run_kernel`); a GPU's kernels run asynchronously on its streams and are
//! not timed one by one, so its table stays empty.

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

/// The seconds, calls and FLOPs of every kernel a device ran, by name, in the order
/// each first ran.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelTimes {
    /// One entry per kernel name.
    pub entries: Vec<KernelTime>,
}

impl KernelTimes {
    /// Counts one call of `name` that took `seconds` and did `flops` operations.
    pub fn add(&mut self, name: &'static str, seconds: f64, flops: f64) {
        match self.entries.iter_mut().find(|e| e.name == name) {
            Some(e) => {
                e.calls += 1;
                e.seconds += seconds;
                e.flops += flops;
            }
            None => self.entries.push(KernelTime {
                name,
                calls: 1,
                seconds,
                flops,
            }),
        }
    }

    /// What ran after `before` was taken from the same device: each entry less its
    /// count in `before`, without the kernels that did not run since.
    pub fn since(&self, before: &KernelTimes) -> KernelTimes {
        let entries = self
            .entries
            .iter()
            .filter_map(|e| {
                let old = before.entries.iter().find(|o| o.name == e.name);
                let (calls, seconds, flops) =
                    old.map_or((0, 0.0, 0.0), |o| (o.calls, o.seconds, o.flops));
                (e.calls > calls).then(|| KernelTime {
                    name: e.name,
                    calls: e.calls - calls,
                    seconds: e.seconds - seconds,
                    flops: e.flops - flops,
                })
            })
            .collect();
        KernelTimes { entries }
    }

    /// Seconds of every kernel.
    pub fn seconds(&self) -> f64 {
        self.entries.iter().map(|e| e.seconds).sum()
    }

    /// The entries whose names `pick` accepts, summed as one (named `name`).
    pub fn sum_of(&self, name: &'static str, pick: impl Fn(&str) -> bool) -> KernelTime {
        self.entries.iter().filter(|e| pick(e.name)).fold(
            KernelTime {
                name,
                calls: 0,
                seconds: 0.0,
                flops: 0.0,
            },
            |sum, e| KernelTime {
                name,
                calls: sum.calls + e.calls,
                seconds: sum.seconds + e.seconds,
                flops: sum.flops + e.flops,
            },
        )
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
        let before = times.clone();
        times.add("matmul", 2.0, 10.0);
        times.add("layernorm", 0.25, 1.0);
        let after = times.since(&before);
        assert_eq!(
            after.entries,
            vec![
                KernelTime {
                    name: "matmul",
                    calls: 1,
                    seconds: 2.0,
                    flops: 10.0
                },
                KernelTime {
                    name: "layernorm",
                    calls: 1,
                    seconds: 0.25,
                    flops: 1.0
                },
            ]
        );
        assert_eq!(after.seconds(), 2.25);
        let products = times.sum_of("products", |n| n.starts_with("mat"));
        assert_eq!((products.calls, products.seconds), (2, 3.0));
    }
}
