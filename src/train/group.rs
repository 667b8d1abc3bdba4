//! The ranks a run trains in ([`Ranks`]): under `mpirun`, every rank of the job; else
//! this process alone. What the ranks agree on before training: each rank's swap folders,
//! the budgets every rank plans with ([`shared_budgets`]), rank 0's measured rates, and
//! that every rank made the same plan.
//!
//! Not here: the collectives themselves (`strata_comm`) or the ZeRO-3 sharding (the
//! executor's).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use strata_comm::Collective;
use strata_engine::plan::{Budgets, CostModel, Plan};

type Error = Box<dyn std::error::Error>;

/// The group this run trains in (none: alone), and this process's place in it.
pub struct Ranks {
    /// The group; `None` for one process.
    pub group: Option<Arc<dyn Collective>>,
    /// This process's rank.
    pub rank: usize,
    /// How many ranks there are.
    pub ranks: usize,
}

impl Ranks {
    /// This process's place in `group`.
    pub fn of(group: Option<Arc<dyn Collective>>) -> Self {
        let (rank, ranks) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
        Ranks { group, rank, ranks }
    }

    /// Where this rank prints: rank 0 to standard output, the others nowhere.
    pub fn out(&self) -> Box<dyn Write> {
        if self.rank == 0 {
            Box::new(std::io::stdout().lock())
        } else {
            Box::new(std::io::sink())
        }
    }

    /// `--nvme` folders of this rank: `{rank}` in a path is replaced by the rank; with
    /// several ranks, a path without it gets a `rank-N` folder of its own.
    pub fn nvme_dirs(&self, dirs: &[PathBuf]) -> Vec<PathBuf> {
        dirs.iter()
            .map(|d| {
                let text = d.to_string_lossy();
                if text.contains("{rank}") {
                    PathBuf::from(text.replace("{rank}", &self.rank.to_string()))
                } else if self.ranks > 1 {
                    d.join(format!("rank-{}", self.rank))
                } else {
                    d.clone()
                }
            })
            .collect()
    }

    /// With several ranks, the collective rate measured by every rank together; then rank
    /// 0's rates on every rank, so that `auto` picks the same policy everywhere.
    pub fn agree_on_rates(&self, cost: &mut CostModel, shard_bytes: usize) -> Result<(), Error> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        if self.ranks > 1 {
            // Every rank times the group's all-gather of a layer's shard together.
            cost.collective_bytes_per_s =
                CostModel::calibrate_collective(group.as_ref(), shard_bytes)?;
        }
        from_rank0(
            group.as_ref(),
            &mut [
                &mut cost.compute_flops,
                &mut cost.h2d_bytes_per_s,
                &mut cost.d2h_bytes_per_s,
                &mut cost.nvme_read_bytes_per_s,
                &mut cost.nvme_write_bytes_per_s,
                &mut cost.adam_params_per_s,
                &mut cost.collective_bytes_per_s,
            ],
        )
    }

    /// Refuses a plan another rank did not make too.
    pub fn check_same_plan(&self, plan: &Plan) -> Result<(), Error> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        let mine = [
            plan.ops.len() as f64,
            plan.peak[0] as f64,
            plan.peak[1] as f64,
        ];
        let mut all = vec![0u8; 24 * self.ranks];
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        group.all_gather(&bytes, &mut all)?;
        if all.chunks_exact(24).any(|c| c != &bytes[..]) {
            let rank = self.rank;
            return Err(format!(
                "rank {rank}: the ranks made different plans (rank {rank}: {}); every rank \
                 must run the same configuration",
                plan.policy
            )
            .into());
        }
        Ok(())
    }

    /// Which GPU this rank drives: with ranks, the one of its rank on its node.
    pub fn cuda_ordinal(&self) -> usize {
        if self.ranks > 1 {
            strata_comm::LaunchEnv::from_env()
                .and_then(|e| e.local_rank)
                .unwrap_or(self.rank)
        } else {
            0
        }
    }
}

/// The group this run trains in: under `mpirun`, every rank of the job (MPI, when this
/// build has it); else none, this process alone.
pub fn open_group() -> Result<Option<Arc<dyn Collective>>, Error> {
    if let Some(message) = strata_comm::mpi_missing_message() {
        return Err(message.into());
    }
    #[cfg(feature = "mpi")]
    if let Some(mpi) = strata_comm::Mpi::init()? {
        return Ok(Some(Arc::new(mpi)));
    }
    Ok(None)
}

/// Rank 0's `values` on every rank (a broadcast of their bytes).
fn from_rank0(group: &dyn Collective, values: &mut [&mut f64]) -> Result<(), Error> {
    let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    group.broadcast(0, &mut bytes)?;
    for (v, b) in values.iter_mut().zip(bytes.chunks_exact(8)) {
        **v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
    }
    Ok(())
}

/// A number that is the same for processes of one machine and differs between machines
/// (its boot id, else its host name, hashed).
pub fn machine_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    // SipHash with fixed keys: the same in every process of this build.
    let mut h = std::hash::DefaultHasher::new();
    id.trim().hash(&mut h);
    h.finish()
}

/// With ranks, the budgets every rank plans with. A budget the user gave is per rank, as
/// stated. One taken from this machine (its free memory or disk; `measured`, per tier) is
/// shared by the ranks on it: each rank's share is that divided by how many ranks run
/// here. Every rank plans with the smallest share of any rank (the same plan everywhere,
/// fitting everywhere).
pub fn shared_budgets(
    group: &dyn Collective,
    budgets: &mut Budgets,
    measured: [bool; 3],
    machine: u64,
) -> Result<(), Error> {
    let mut machines = vec![0u8; 8 * group.size()];
    group.all_gather(&machine.to_le_bytes(), &mut machines)?;
    let here = machines
        .chunks_exact(8)
        .filter(|m| *m == machine.to_le_bytes())
        .count() as u64;
    let mut mine = [budgets.device, budgets.host, budgets.nvme];
    for (b, shared) in mine.iter_mut().zip(measured) {
        if shared {
            *b /= here.max(1);
        }
    }
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut all = vec![0u8; 24 * group.size()];
    group.all_gather(&bytes, &mut all)?;
    for (i, b) in mine.iter_mut().enumerate() {
        *b = all
            .chunks_exact(24)
            .map(|r| u64::from_le_bytes(r[8 * i..8 * i + 8].try_into().expect("8 bytes")))
            .min()
            .unwrap_or(*b);
    }
    (budgets.device, budgets.host, budgets.nvme) = (mine[0], mine[1], mine[2]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks on one machine: what each took from the machine is halved, what was
    /// stated is not, and both plan with the smaller share; on two machines nothing is
    /// divided.
    #[test]
    fn ranks_of_one_machine_share_its_measured_budgets() {
        let run = |machines: [u64; 2]| -> Vec<Budgets> {
            let group = strata_comm::ThreadGroup::new(2, std::time::Duration::from_secs(30));
            std::thread::scope(|s| {
                let handles: Vec<_> = group
                    .into_iter()
                    .map(|g| {
                        s.spawn(move || {
                            let r = g.rank() as u64;
                            let mut b = Budgets {
                                device: 1000 + r,
                                host: 800 + 100 * r,
                                nvme: 600,
                            };
                            shared_budgets(&g, &mut b, [false, true, true], machines[r as usize])
                                .unwrap();
                            b
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let same = run([7, 7]);
        for b in &same {
            assert_eq!((b.device, b.host, b.nvme), (1000, 400, 300), "{same:?}");
        }
        let apart = run([7, 8]);
        for b in &apart {
            assert_eq!((b.device, b.host, b.nvme), (1000, 800, 600), "{apart:?}");
        }
        assert_eq!(machine_id(), machine_id());
    }
}
