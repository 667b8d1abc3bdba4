//! [`Mpi`]: one rank per process under `mpirun`, through rsmpi's raw bindings. The one
//! file of the crate with `unsafe`: each block is one MPI call on buffers whose lengths
//! the call-description exchange has just checked on every rank.
//!
//! rsmpi's safe collectives ignore MPI's return codes, so the collectives here call the
//! C functions (`mpi::ffi`) on a duplicate of `MPI_COMM_WORLD` whose error handler is
//! `MPI_ERRORS_RETURN`, and map every code to [`CommError::Transport`]. rsmpi is used for
//! what it does well: initialisation with a thread level and finalisation when its
//! `Universe` drops.
//!
//! Every collective starts with one small `MPI_Allgather` of each rank's call
//! description (which collective, its lengths, its root; 32 bytes per rank), checked
//! by every rank on the same data: a mismatch is the same error on every rank, where
//! MPI itself would hang, truncate or move the wrong bytes. It costs one latency-bound
//! collective per call, small beside a block's parameters or gradients.

use std::os::raw::{c_char, c_int, c_void};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::environment::Universe;
use mpi::ffi;

use crate::call::{CALL_WORDS, Call, check_calls};
use crate::fold::{fold_f32, fold_f64};
use crate::{Collective, CommError, launched_by_mpirun};

/// The ranks of an MPI job, one per process, over `MPI_COMM_WORLD`.
///
/// Any thread may call it: MPI runs at `MPI_THREAD_SERIALIZED` or above and every call
/// holds one lock. `MPI_Finalize` runs when it drops, which must happen on the thread that
/// called [`Mpi::init`] (MPI's rule), after every rank's last collective.
///
/// **Ending a rank.** A rank that cannot go on should call [`Collective::abort`]
/// (`MPI_Abort`: the launcher ends every process of the job, and `mpirun` exits non-zero
/// at once). MPI collectives have no timeout; a rank whose process dies is noticed by the
/// launcher, which ends the job. What is left is a rank that returns from `main` with an
/// error while its peers wait for it in a collective: plain `MPI_Finalize` would then
/// wait for them forever. So dropping an `Mpi` first meets every rank in a barrier of its
/// own (on a communicator no collective uses, so it cannot match one) and waits at most
/// [`Mpi::exit_timeout`] for it; a rank that does not get there in time aborts the job.
/// At the end of a run, then, no rank may drop its `Mpi` more than the exit timeout
/// before the last one: end with [`Collective::barrier`] after any work one rank does
/// alone (a final checkpoint). Dropping an `Mpi` while the thread panics aborts the job
/// at once.
pub struct Mpi {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    exit_timeout: Duration,
    inner: Mutex<Inner>,
    /// Declared last so it drops last: `MPI_Finalize` after the communicator is freed.
    _universe: Universe,
}

/// What a call needs under the lock: the communicator and the grow-only scratch.
struct Inner {
    /// A duplicate of `MPI_COMM_WORLD` with `MPI_ERRORS_RETURN`, so this crate's traffic
    /// cannot match another library's messages on the world communicator.
    comm: ffi::MPI_Comm,
    /// A second duplicate, for the barrier on drop alone.
    exit_comm: ffi::MPI_Comm,
    /// Every rank's call description, `size * CALL_WORDS` words.
    call_words: Vec<u64>,
    /// The decoded descriptions, one per rank.
    calls: Vec<Call>,
    /// The all-to-all's receive buffer (reduce_scatter_sum). Grow-only.
    f32_recv: Vec<f32>,
    /// The all-gather's receive buffer (all_reduce_sum_f64). Grow-only.
    f64_recv: Vec<f64>,
}

// SAFETY: `MPI_Comm` is a handle (a pointer in Open MPI) that MPI lets any thread use at
// `MPI_THREAD_SERIALIZED` as long as calls do not overlap; `Inner` lives behind the
// `Mutex` in `Mpi` and every MPI call holds that lock.
unsafe impl Send for Inner {}

impl Mpi {
    /// Initialises MPI at `MPI_THREAD_SERIALIZED` (or above) when this process was
    /// started by an MPI launcher ([`launched_by_mpirun`]); `Ok(None)` when it was not,
    /// for the caller to run as one process ([`Solo`](crate::Solo)).
    ///
    /// Fails when MPI grants a lower thread level, when MPI was initialised already in
    /// this process (once per process: MPI cannot be initialised again after
    /// finalisation), or when an MPI call fails.
    pub fn init() -> Result<Option<Mpi>, CommError> {
        if !launched_by_mpirun() {
            return Ok(None);
        }
        let Some((universe, granted)) = mpi::initialize_with_threading(Threading::Serialized)
        else {
            return Err(CommError::Init {
                detail: "MPI was initialised already in this process; Mpi::init may run once per process".into(),
            });
        };
        if granted < Threading::Serialized {
            return Err(CommError::Init {
                detail: format!(
                    "the MPI library granted thread level {granted:?}; strata needs at least Serialized (any thread calls MPI, one at a time). Use an MPI built with thread support (Debian's and Ubuntu's Open MPI and MPICH are)"
                ),
            });
        }
        // SAFETY: MPI is initialised; MPI_COMM_WORLD and MPI_ERRORS_RETURN are valid
        // handles for the whole run. Setting the handler first makes the duplicate
        // below inherit it, and makes a failing dup return rather than abort.
        check("MPI_Comm_set_errhandler", unsafe {
            ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN)
        })?;
        // SAFETY: reading a constant handle of the initialised library.
        let mut comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: `comm` is a valid place for the new handle.
        check("MPI_Comm_dup", unsafe {
            ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm)
        })?;
        let mut exit_comm = comm;
        // SAFETY: as above.
        check("MPI_Comm_dup", unsafe {
            ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut exit_comm)
        })?;
        let (rank, size) = rank_and_size(comm)?;
        let (local_rank, local_size) = match local_from_env() {
            Some(local) => local,
            None => local_by_split(comm, rank)?,
        };
        log::info!(
            "MPI rank {rank} of {size} (local rank {local_rank} of {local_size}), thread level {granted:?}"
        );
        Ok(Some(Mpi {
            rank,
            size,
            local_rank,
            local_size,
            exit_timeout: Mpi::EXIT_TIMEOUT_DEFAULT,
            inner: Mutex::new(Inner {
                comm,
                exit_comm,
                call_words: vec![0; size * CALL_WORDS],
                calls: vec![Call::barrier(); size],
                f32_recv: Vec::new(),
                f64_recv: Vec::new(),
            }),
            _universe: universe,
        }))
    }

    /// How long dropping an `Mpi` waits for every rank by default: long enough for ranks
    /// that finish a run a little apart, short enough that a job whose rank failed ends.
    pub const EXIT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);

    /// How long dropping this `Mpi` waits for every other rank to drop theirs before it
    /// aborts the job (see [`Mpi`]).
    pub fn exit_timeout(&self) -> Duration {
        self.exit_timeout
    }

    /// Sets [`Mpi::exit_timeout`].
    pub fn set_exit_timeout(&mut self, timeout: Duration) {
        self.exit_timeout = timeout;
    }

    /// This process's rank among the processes on its node (for choosing its GPU): from
    /// `OMPI_COMM_WORLD_LOCAL_RANK` where Open MPI sets it, else from splitting the world
    /// by shared memory (`MPI_Comm_split_type` with `MPI_COMM_TYPE_SHARED`).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// How many ranks share this process's node, found as [`Mpi::local_rank`] is.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The lock guards no invariant a panic could break: the scratch is overwritten by
        // every call before it is read.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// Exchanges this rank's call description with every rank and checks them all; the
    /// same verdict on every rank.
    fn agree(&mut self, call: Call) -> Result<(), CommError> {
        let words = call.to_words();
        // SAFETY: `words` holds CALL_WORDS u64s and `call_words` size * CALL_WORDS, as
        // every rank passes CALL_WORDS (a constant of this crate).
        check("MPI_Allgather", unsafe {
            ffi::MPI_Allgather(
                words.as_ptr().cast::<c_void>(),
                CALL_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                self.call_words.as_mut_ptr().cast::<c_void>(),
                CALL_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                self.comm,
            )
        })?;
        for (rank, words) in self.call_words.chunks_exact(CALL_WORDS).enumerate() {
            match Call::from_words(words) {
                Some(call) => self.calls[rank] = call,
                // Only a rank running another build of this crate sends words no Call
                // wrote: it is at a different call, as far as this build can tell.
                None => {
                    let ops = self.call_words.chunks_exact(CALL_WORDS).map(|words| {
                        Call::from_words(words)
                            .map_or("(unreadable: another strata build?)", |c| c.op.name())
                    });
                    return Err(CommError::OpMismatch { ops: ops.collect() });
                }
            }
        }
        check_calls(&self.calls)
    }
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .finish()
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let mut inner = self.lock();
        inner.agree(Call::all_gather(send.len(), recv.len()))?;
        let Some(count) = mpi_count("all_gather", send.len(), "bytes")? else {
            return Ok(());
        };
        // SAFETY: `send` holds `count` bytes and `recv` size * `count` (checked by
        // `agree` on every rank, so every rank passes the same count).
        check("MPI_Allgather", unsafe {
            ffi::MPI_Allgather(
                send.as_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_UINT8_T,
                recv.as_mut_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_UINT8_T,
                inner.comm,
            )
        })
    }

    /// `MPI_Alltoall` of the f32 buffer (chunk q to rank q) into a grow-only scratch,
    /// then the left fold in rank order on this rank; never `MPI_Reduce_scatter`, whose
    /// summation order MPI leaves open.
    fn reduce_scatter_sum(
        &self,
        send: &[f32],
        acc: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CommError> {
        let mut inner = self.lock();
        inner.agree(Call::reduce_scatter_sum(send.len(), acc.len()))?;
        let m = acc.len();
        let Some(count) = mpi_count("reduce_scatter_sum", m, "f32 elements")? else {
            return Ok(());
        };
        let Inner { comm, f32_recv, .. } = &mut *inner;
        if f32_recv.len() < send.len() {
            f32_recv.resize(send.len(), 0.0);
        }
        let recv = &mut f32_recv[..send.len()];
        // SAFETY: `send` and `recv` each hold size * `count` f32s (checked by `agree`
        // on every rank, so every rank passes the same count).
        check("MPI_Alltoall", unsafe {
            ffi::MPI_Alltoall(
                send.as_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_FLOAT,
                recv.as_mut_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_FLOAT,
                *comm,
            )
        })?;
        let recv = &*recv;
        fold_f32(acc, accumulate, self.size, |p| &recv[p * m..(p + 1) * m]);
        Ok(())
    }

    /// `MPI_Allgather` of every rank's values, then the fold in rank order on every
    /// rank; never `MPI_Allreduce`, whose summation order MPI leaves open.
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        let mut inner = self.lock();
        inner.agree(Call::all_reduce_sum_f64(values.len()))?;
        let m = values.len();
        let Some(count) = mpi_count("all_reduce_sum_f64", m, "f64 elements")? else {
            return Ok(());
        };
        let Inner { comm, f64_recv, .. } = &mut *inner;
        let total = self.size * m;
        if f64_recv.len() < total {
            f64_recv.resize(total, 0.0);
        }
        let recv = &mut f64_recv[..total];
        // SAFETY: `values` holds `count` f64s and `recv` size * `count` (checked by
        // `agree` on every rank).
        check("MPI_Allgather", unsafe {
            ffi::MPI_Allgather(
                values.as_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_DOUBLE,
                recv.as_mut_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_DOUBLE,
                *comm,
            )
        })?;
        let recv = &*recv;
        fold_f64(values, self.size, |p| &recv[p * m..(p + 1) * m]);
        Ok(())
    }

    fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        let mut inner = self.lock();
        inner.agree(Call::broadcast(root, buf.len()))?;
        let Some(count) = mpi_count("broadcast", buf.len(), "bytes")? else {
            return Ok(());
        };
        // SAFETY: `buf` holds `count` bytes on every rank and `root` is a rank of the
        // group (both checked by `agree`); the root cast cannot truncate (root < size,
        // and MPI sizes are c_int).
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(
                buf.as_mut_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_UINT8_T,
                root as c_int,
                inner.comm,
            )
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut inner = self.lock();
        inner.agree(Call::barrier())?;
        // SAFETY: a valid communicator; no buffers.
        check("MPI_Barrier", unsafe { ffi::MPI_Barrier(inner.comm) })
    }

    /// Prints the reason to stderr (the process is about to end, so a logger may never
    /// flush) and calls `MPI_Abort` on `MPI_COMM_WORLD`: the launcher ends every process
    /// of the job and `mpirun` exits non-zero. Does not return. Does not take the lock:
    /// a rank whose other thread waits in a collective for a dead peer must still end.
    fn abort(&self, why: &str) {
        eprintln!(
            "strata-comm: rank {} of {} aborts the MPI job: {why}",
            self.rank, self.size
        );
        log::error!(
            "rank {} of {} aborts the MPI job: {why}",
            self.rank,
            self.size
        );
        // SAFETY: MPI is initialised (self exists) and not finalised (that happens when
        // self drops); MPI_Abort may overlap another thread's call here, which MPI does
        // not promise to support at this thread level, but the process ends either way.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
        // MPI_Abort does not return on any implementation strata knows of.
        std::process::abort();
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("a thread panicked while this rank was part of the job");
        }
        if let Err(why) = self.meet_every_rank() {
            self.abort(&why);
        }
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        for comm in [&mut inner.comm, &mut inner.exit_comm] {
            // SAFETY: each came from MPI_Comm_dup and is freed once, here, before the
            // Universe drops and finalises MPI.
            let code = unsafe { ffi::MPI_Comm_free(comm) };
            if let Err(e) = check("MPI_Comm_free", code) {
                log::warn!("{e}");
            }
        }
    }
}

impl Mpi {
    /// The barrier on drop: `MPI_Ibarrier` on the exit communicator, polled until it
    /// completes or the exit timeout passes.
    fn meet_every_rank(&mut self) -> Result<(), String> {
        let exit_timeout = self.exit_timeout;
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: reading a constant handle of the initialised library.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: a valid communicator and a valid place for the request.
        check("MPI_Ibarrier", unsafe {
            ffi::MPI_Ibarrier(inner.exit_comm, &mut request)
        })
        .map_err(|e| e.to_string())?;
        let started = Instant::now();
        loop {
            let mut done: c_int = 0;
            // SAFETY: `request` is the live request from MPI_Ibarrier (MPI_Test sets it
            // to MPI_REQUEST_NULL when it completes, and the loop stops then).
            check("MPI_Test", unsafe {
                ffi::MPI_Test(&mut request, &mut done, ffi::RSMPI_STATUS_IGNORE)
            })
            .map_err(|e| e.to_string())?;
            if done != 0 {
                return Ok(());
            }
            if started.elapsed() >= exit_timeout {
                return Err(format!(
                    "ending, this rank waited {} s for the others to end too, and they did not: one of them is still in a collective (waiting for this rank, which may have ended with an error) or still working alone (end runs with a barrier)",
                    exit_timeout.as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Maps an MPI return code to `Ok` or [`CommError::Transport`] with MPI's own text.
fn check(op: &'static str, code: c_int) -> Result<(), CommError> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `text` holds MPI_MAX_ERROR_STRING bytes, as MPI_Error_string requires.
    let described =
        unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast::<c_char>(), &mut len) };
    let message = if described == ffi::MPI_SUCCESS as c_int {
        text.truncate(usize::try_from(len).unwrap_or(0).min(text.len()));
        String::from_utf8_lossy(&text).into_owned()
    } else {
        "(MPI_Error_string could not describe it)".to_string()
    };
    Err(CommError::Transport { op, code, message })
}

/// MPI counts are C ints. Lengths are equal on every rank by the time this runs, so every
/// rank returns the same error.
///
/// `Ok(None)` for 0: nothing to move, and every rank skips the MPI call alike. (Two empty
/// slices share one dangling address, which Open MPI rejects as an aliased send and
/// receive buffer.)
fn mpi_count(op: &'static str, len: usize, unit: &str) -> Result<Option<c_int>, CommError> {
    if len == 0 {
        return Ok(None);
    }
    c_int::try_from(len)
        .map(Some)
        .map_err(|_| CommError::LengthMismatch {
            op,
            detail: format!(
                "{len} {unit} per rank is more than one MPI call can move ({}); split the call",
                c_int::MAX
            ),
        })
}

fn rank_and_size(comm: ffi::MPI_Comm) -> Result<(usize, usize), CommError> {
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: a valid communicator and valid places for the results.
    check("MPI_Comm_rank", unsafe {
        ffi::MPI_Comm_rank(comm, &mut rank)
    })?;
    // SAFETY: as above.
    check("MPI_Comm_size", unsafe {
        ffi::MPI_Comm_size(comm, &mut size)
    })?;
    // MPI ranks and sizes are never negative.
    Ok((rank as usize, size as usize))
}

/// Open MPI's own word for the node-local rank and size, where it gives them.
fn local_from_env() -> Option<(usize, usize)> {
    let number = |name| std::env::var(name).ok()?.trim().parse::<usize>().ok();
    let local_rank = number("OMPI_COMM_WORLD_LOCAL_RANK")?;
    let local_size = number("OMPI_COMM_WORLD_LOCAL_SIZE")?;
    (local_rank < local_size).then_some((local_rank, local_size))
}

/// The node-local rank and size by splitting `comm` into the processes that can share
/// memory (a collective: every rank calls it, which holds because every rank of one job
/// sees the same launcher environment).
fn local_by_split(comm: ffi::MPI_Comm, rank: usize) -> Result<(usize, usize), CommError> {
    // SAFETY: reading a constant handle of the initialised library.
    let mut node = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: a valid communicator, MPI's own split type and info constants, and a valid
    // place for the new handle. The key keeps world order inside the node.
    check("MPI_Comm_split_type", unsafe {
        ffi::MPI_Comm_split_type(
            comm,
            ffi::RSMPI_COMM_TYPE_SHARED,
            rank as c_int,
            ffi::RSMPI_INFO_NULL,
            &mut node,
        )
    })?;
    let local = rank_and_size(node);
    // SAFETY: `node` came from the split above and is freed once.
    check("MPI_Comm_free", unsafe { ffi::MPI_Comm_free(&mut node) })?;
    local
}
