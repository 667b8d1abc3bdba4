//! [`Solo`]: the group of one process, what a run without data parallelism uses. Every
//! collective is a copy or a one-term fold; lengths are checked exactly as the other
//! transports check them, so code that is wrong for N ranks is already wrong for one.

use std::sync::Mutex;

use crate::call::{Call, check_calls};
use crate::fold::fold_f32;
use crate::{Collective, CommError};

/// A group of size 1: rank 0 of 1.
///
/// [`Collective::abort`] marks it aborted: every later call returns
/// [`CommError::Aborted`].
#[derive(Debug, Default)]
pub struct Solo {
    aborted: Mutex<Option<String>>,
}

impl Solo {
    /// The group of this process alone.
    pub fn new() -> Solo {
        Solo::default()
    }

    fn check(&self, call: Call) -> Result<(), CommError> {
        if let Some(why) = &*self.aborted.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(CommError::Aborted {
                rank: 0,
                why: why.clone(),
            });
        }
        check_calls(&[call])
    }
}

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        self.check(Call::all_gather(send.len(), recv.len()))?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn reduce_scatter_sum(
        &self,
        send: &[f32],
        acc: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CommError> {
        self.check(Call::reduce_scatter_sum(send.len(), acc.len()))?;
        fold_f32(acc, accumulate, 1, |_| send);
        Ok(())
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        self.check(Call::all_reduce_sum_f64(values.len()))
    }

    fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        self.check(Call::broadcast(root, buf.len()))
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.check(Call::barrier())
    }

    fn abort(&self, why: &str) {
        let mut aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        aborted.get_or_insert_with(|| why.to_string());
    }
}
