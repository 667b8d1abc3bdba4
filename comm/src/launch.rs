//! What the launcher (`mpirun`, `srun`, any PMI launcher) tells a process through its
//! environment, read without MPI: compiled with or without the `mpi` feature, so that a
//! build without MPI started under `mpirun` can say so instead of training N copies of
//! the same model side by side. Does not initialise MPI.

/// Whether this build of strata-comm has the `mpi` feature.
pub const BUILT_WITH_MPI: bool = cfg!(feature = "mpi");

/// Whether this process was started by an MPI launcher: Open MPI's `mpirun` sets
/// `OMPI_COMM_WORLD_SIZE`, MPICH's Hydra and Slurm set `PMI_SIZE`, PMIx launchers set
/// `PMIX_RANK`.
pub fn launched_by_mpirun() -> bool {
    launched_by(|name| std::env::var_os(name).is_some())
}

fn launched_by(is_set: impl Fn(&str) -> bool) -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .into_iter()
        .any(is_set)
}

/// The message for a user who started a build without MPI under `mpirun`, or `None`
/// when there is nothing to say (not under a launcher, or built with MPI).
pub fn mpi_missing_message() -> Option<&'static str> {
    (!BUILT_WITH_MPI && launched_by_mpirun()).then_some(
        "this strata was built without MPI support; rebuild with `cargo build --release --features mpi`",
    )
}

/// Rank, size and local rank as the launcher set them in the environment, before (or
/// without) initialising MPI: enough to pick this rank's GPU early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank in the world.
    pub rank: usize,
    /// The world's size.
    pub size: usize,
    /// This process's rank among the processes on its node, where the launcher says
    /// (`OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`, `SLURM_LOCALID`).
    pub local_rank: Option<usize>,
}

impl LaunchEnv {
    /// Reads the launcher's variables; `None` when not under a launcher, or when its
    /// variables do not parse or contradict each other (rank not below size).
    pub fn from_env() -> Option<LaunchEnv> {
        LaunchEnv::from_vars(|name| std::env::var(name).ok())
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Option<LaunchEnv> {
        let number = |names: &[&str]| {
            names
                .iter()
                .find_map(|name| var(name))
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        let rank = number(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])?;
        let size = number(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])?;
        let local_rank = number(&[
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "SLURM_LOCALID",
        ]);
        (rank < size).then_some(LaunchEnv {
            rank,
            size,
            local_rank,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn open_mpi_and_pmi() {
        let ompi = vars(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ]);
        assert!(launched_by(|n| ompi(n).is_some()));
        assert_eq!(
            LaunchEnv::from_vars(ompi),
            Some(LaunchEnv {
                rank: 2,
                size: 4,
                local_rank: Some(0)
            })
        );
        let pmi = vars(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]);
        assert!(launched_by(|n| pmi(n).is_some()));
        assert_eq!(
            LaunchEnv::from_vars(pmi),
            Some(LaunchEnv {
                rank: 1,
                size: 2,
                local_rank: None
            })
        );
        let none = vars(&[]);
        assert!(!launched_by(|n| none(n).is_some()));
        assert_eq!(LaunchEnv::from_vars(none), None);
        assert_eq!(
            LaunchEnv::from_vars(vars(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")])),
            None
        );
        assert_eq!(
            LaunchEnv::from_vars(vars(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")])),
            None
        );
    }
}
