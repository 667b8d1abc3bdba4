//! What moves into and out of the executor's homes outside a step: loading the training
//! state (master parameters, AdamW's moments, the working parameters made from them) into
//! each block's homes on the device, in host memory or on NVMe, and reading it back
//! (export), whole or a block at a time (for checkpoints of a model larger than memory).
//! With ranks each rank holds its shard, loads and lends it a block at a time, and whole
//! blocks are gathered one at a time where a home or a reader of the model needs them.
//!
//! Not here: how bytes reach a home (the arenas, `arenas.rs`; the NVMe tier,
//! `extents.rs`), or what a step moves (the plan's operations).

use strata_kernels::ops::Cpu;
use strata_kernels::program::Dtype;
use strata_storage::AlignedBuf;

use super::error::ExecError;
use super::executor::Executor;
use super::moments::{decode_moments, encode_moments};
use crate::device::{DeviceRange, bytes_of, bytes_of_mut, cast, cast_mut};
use crate::lane::Lane;
use crate::memory::{HostArena, HostRange};
use crate::model::{ModelError, quant_base};
use crate::plan::{BufId, Precision, Tier};

/// AdamW's first and second moments, one buffer per block.
pub type Moments<'a> = (&'a [Vec<f32>], &'a [Vec<f32>]);

/// The most bytes of pinned staging loading uses (one piece of a device home at a time):
/// 64 MiB, or 12 B per parameter of the largest block when that is less.
pub fn load_staging_bytes(largest_block: usize) -> usize {
    (12 * largest_block)
        .clamp(4096, 64 << 20)
        .next_multiple_of(4096)
}

/// Master parameters, m and v, one f32 buffer per block each.
pub type TrainingState = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// What [`Executor::load`], [`Executor::load_blocks`], [`Executor::load_state_blocks`]
/// and [`Executor::load_shard_blocks`] write.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Whole blocks, of which each rank takes its shards.
    Whole {
        params: &'a [Vec<f32>],
        moments: Option<Moments<'a>>,
    },
    /// Whole blocks, each made when it is loaded (zero moments), so that no more than
    /// one block's parameters are held at once.
    Blocks(&'a dyn Fn(usize) -> Result<Vec<f32>, ModelError>),
    /// Whole blocks' master parameters, m and v, each read when it is loaded, so that no
    /// more than one block's state is held at once.
    States(&'a dyn Fn(usize) -> Result<[Vec<f32>; 3], ModelError>),
    /// This rank's shards of the blocks' master parameters, m and v, each read when it
    /// is loaded, so that no more than one block's shard is held at once.
    ShardStates(&'a dyn Fn(usize) -> Result<[Vec<f32>; 3], ModelError>),
}

/// One block of a [`Source`].
#[derive(Clone, Copy)]
enum BlockSource<'a> {
    /// The whole block's master parameters, and its moments (zero when none); each rank
    /// takes its shard.
    Whole {
        params: &'a [f32],
        moments: Option<(&'a [f32], &'a [f32])>,
    },
    /// This rank's shard of the master parameters, m and v.
    Shard {
        params: &'a [f32],
        m: &'a [f32],
        v: &'a [f32],
    },
}

impl Executor {
    /// Writes `params` (one f32 buffer per block) as the master and working parameters,
    /// and `moments` as AdamW's m and v (zero when `None`), to their homes. With ranks,
    /// each rank takes its shards from them.
    pub fn load(
        &mut self,
        params: &[Vec<f32>],
        moments: Option<Moments<'_>>,
    ) -> Result<(), ExecError> {
        let blocks = self.model.blocks();
        if params.len() != blocks.len() || params.iter().zip(blocks).any(|(p, b)| p.len() != b.len)
        {
            return Err(ExecError::BadInput(format!(
                "parameters do not match the model's {} blocks",
                blocks.len()
            )));
        }
        if let Some((m, v)) = moments
            && (m.len() != blocks.len()
                || v.len() != blocks.len()
                || m.iter()
                    .chain(v)
                    .zip(blocks.iter().chain(blocks))
                    .any(|(x, b)| x.len() != b.len))
        {
            return Err(ExecError::BadInput(
                "optimizer moments do not match the model's blocks".into(),
            ));
        }
        self.load_from(Source::Whole { params, moments })
    }

    /// As [`Executor::load`] with zero moments, the parameters of block `b` being
    /// `make(b)`, called once per block in order and dropped once written: loading holds
    /// one block's parameters, not the model's (`Model::init_block` initialises a model
    /// larger than the memory its whole parameters would take beside the executor's).
    /// An error of `make` (a tensor of a model folder that cannot be used) stops the load
    /// and is returned.
    pub fn load_blocks(
        &mut self,
        make: &dyn Fn(usize) -> Result<Vec<f32>, ModelError>,
    ) -> Result<(), ExecError> {
        self.load_from(Source::Blocks(make))
    }

    /// As [`Executor::load`], block `b`'s master parameters, m and v being `read(b)`,
    /// called once per block in order and dropped once written: loading holds one
    /// block's state, not the model's (a checkpoint read a block at a time,
    /// [`crate::checkpoint::Opened::block`]). With ranks each rank takes its shard of
    /// every block. An error of `read` stops the load and is returned.
    pub fn load_state_blocks(
        &mut self,
        read: &dyn Fn(usize) -> Result<[Vec<f32>; 3], ModelError>,
    ) -> Result<(), ExecError> {
        self.load_from(Source::States(read))
    }

    /// Writes this rank's shards (per block, [`Executor::shard`]'s length of the master
    /// parameters, m and v, as [`Executor::export_shard`] returns them) to their homes,
    /// block `b`'s being `read(b)`, called once per block in order and dropped once
    /// written: a resume by as many ranks as wrote a sharded checkpoint holds one
    /// block's shard, not the rank's whole shard of the model
    /// ([`crate::checkpoint::open_shard`]). With ranks it is a collective where working
    /// parameters live whole on the device (every rank calls it; the blocks' parameters
    /// are gathered).
    pub fn load_shard_blocks(
        &mut self,
        read: &dyn Fn(usize) -> Result<[Vec<f32>; 3], ModelError>,
    ) -> Result<(), ExecError> {
        self.load_from(Source::ShardStates(read))
    }

    fn load_from(&mut self, source: Source<'_>) -> Result<(), ExecError> {
        // Fresh parameters: no delayed update is waiting, and the next step fetches its
        // first parameters anew.
        self.pending = None;
        self.head_fetched = false;
        let blocks = self.model.blocks();
        let largest = blocks.iter().map(|b| b.len).max().unwrap_or(0);
        let staging = self.staging(load_staging_bytes(largest))?;
        for (b, block) in blocks.iter().enumerate() {
            let made;
            let from = match source {
                Source::Whole { params, moments } => BlockSource::Whole {
                    params: &params[b],
                    moments: moments.map(|(m, v)| (&m[b][..], &v[b][..])),
                },
                Source::Blocks(make) => {
                    made = [make(b)?, Vec::new(), Vec::new()];
                    check_block_len(b, "parameters", &made[..1], block.len)?;
                    BlockSource::Whole {
                        params: &made[0][..],
                        moments: None,
                    }
                }
                Source::States(read) => {
                    made = read(b)?;
                    check_block_len(b, "state", &made, block.len)?;
                    BlockSource::Whole {
                        params: &made[0][..],
                        moments: Some((&made[1][..], &made[2][..])),
                    }
                }
                Source::ShardStates(read) => {
                    made = read(b)?;
                    let shard = self.plan.shard_len[b] as usize;
                    check_block_len(b, "shard", &made, shard)?;
                    BlockSource::Shard {
                        params: &made[0][..],
                        m: &made[1][..],
                        v: &made[2][..],
                    }
                }
            };
            self.load_block(b, from, &staging)?;
        }
        Ok(())
    }

    /// Writes block `b`'s state from `from` (this rank's shard of it: zero past the
    /// block's end) to its home, and its working parameters to theirs when they are not
    /// the master copy. Nothing whole is made beside the home: host homes are written in
    /// place, device homes through `staging` a piece at a time, NVMe homes from the one
    /// aligned buffer their extent is written from.
    fn load_block(
        &self,
        b: usize,
        from: BlockSource<'_>,
        staging: &HostArena,
    ) -> Result<(), ExecError> {
        let homes = self.plan.block_homes[b];
        let (_, shard, valid) = self.shard(b);
        let part = self.shard_part(b);
        // The state's layout: master parameters, m, v, `shard` values each.
        let classes: [Option<&[f32]>; 3] = match from {
            BlockSource::Shard { params, m, v } => {
                [Some(&params[..valid]), Some(&m[..valid]), Some(&v[..valid])]
            }
            BlockSource::Whole { params, moments } => [
                Some(&params[part.clone()]),
                moments.map(|(m, _)| &m[part.clone()]),
                moments.map(|(_, v)| &v[part.clone()]),
            ],
        };
        // Elements [start / 4, ...) of the layout into `out`, a run of one class at a time.
        let fill = |start: usize, out: &mut [u8]| {
            let out = cast_mut::<f32>(out);
            let mut done = 0;
            while done < out.len() {
                let e = start / 4 + done;
                let (class, i) = (e / shard, e % shard);
                let run = (shard - i).min(out.len() - done);
                let to = &mut out[done..done + run];
                let have = classes[class].map_or(&[][..], |c| &c[i.min(c.len())..]);
                let n = have.len().min(run);
                to[..n].copy_from_slice(&have[..n]);
                to[n..].fill(0.0);
                done += run;
            }
        };
        let layout = self.state_layout(b);
        if layout.format.is_fp32() {
            self.put_home(staging, layout.bytes(), 4, &fill, homes.state, None)?;
        } else {
            // Never on the device (the plan refuses it), so written whole: the master
            // parameters as above, the moments converted from f32.
            let bytes = self.state_buffer_bytes(b);
            let compact = |start: usize, out: &mut [u8]| {
                assert_eq!(
                    (start, out.len()),
                    (0, bytes),
                    "compact state is written whole"
                );
                out.fill(0);
                fill(0, &mut out[layout.master()]);
                if let [_, Some(m), Some(v)] = classes {
                    encode_moments(layout, &padded(m, shard), &padded(v, shard), out);
                }
            };
            self.put_home(staging, bytes, 4, &compact, homes.state, None)?;
        }
        if homes.params == homes.state {
            return Ok(()); // the working parameters are the master copy
        }
        self.load_working(b, from, staging)
    }

    /// Writes block `b`'s working parameters, from the master parameters of `from`, to
    /// their home: the whole block to the device (gathered from every rank's shard),
    /// this rank's shard elsewhere.
    fn load_working(
        &self,
        b: usize,
        from: BlockSource<'_>,
        staging: &HostArena,
    ) -> Result<(), ExecError> {
        let home = self.plan.block_homes[b].params;
        let precision = self.plan.shape.precision;
        let pbytes = precision.param_bytes() as usize;
        let (_, shard, valid) = self.shard(b);
        // Alone every home holds the whole block (a LoRA model's base with its
        // adapters); with ranks the device's does, gathered, and the others a shard.
        let whole = self.plan.buffer(home).tier == Tier::Device || self.comm.size() == 1;
        let gathered;
        let master: &[f32] = match (from, whole) {
            (BlockSource::Whole { params, .. }, true) => params,
            (BlockSource::Whole { params, .. }, false) => &params[self.shard_part(b)],
            (BlockSource::Shard { params, .. }, false) => &params[..valid],
            (BlockSource::Shard { params, .. }, true) => {
                // The whole block, from every rank's shard.
                gathered = self.gather_block(b, params)?;
                &gathered
            }
        };
        let len = self.model.blocks()[b].len;
        let homes = self.plan.block_homes[b];
        // A quantised base: its packed image stored, or its matrices as dequantised.
        let quantised;
        let master = match (self.model.base_quant(), homes.packed) {
            (Some(_), Some(packed)) if whole => {
                self.put_packed(b, master, packed, staging)?;
                master
            }
            (Some(quant), None) if whole => {
                let mut values = master.to_vec();
                round_to(precision, &mut values);
                quant_base::round_trip(&self.model.blocks()[b], quant, &mut values);
                quantised = values;
                &quantised[..]
            }
            _ => master,
        };
        let fill = |start: usize, out: &mut [u8]| {
            // A piece past the master values (padding of a shard) is all zero.
            let (first, count) = ((start / pbytes).min(master.len()), out.len() / pbytes);
            let have = master.len().saturating_sub(first).min(count);
            out.fill(0);
            write_working(
                precision,
                &master[first..first + have],
                &mut out[..have * pbytes],
            );
        };
        let convert = (precision.dtype() != self.plan.shape.device_dtype())
            .then(|| (precision.dtype(), self.plan.shape.device_dtype()));
        if homes.params_base.is_some() || homes.packed.is_some() {
            // A LoRA block whose base is stored apart: split on NVMe, its base's extent
            // (packed, written above), then its trained tail's home.
            let at = self.model.blocks()[b].frozen * pbytes;
            if let Some(base) = homes.params_base {
                self.put_home(staging, at, pbytes, &fill, base, convert)?;
            }
            let tail = |start: usize, out: &mut [u8]| fill(at + start, out);
            return self.put_home(staging, len * pbytes - at, pbytes, &tail, home, convert);
        }
        let bytes = if whole { len } else { shard } * pbytes;
        self.put_home(staging, bytes, pbytes, &fill, home, convert)
    }

    /// Writes block `b`'s packed base, quantised from `values` (the block's f32 values,
    /// each tensor rounded to the working precision first), to its home `packed`: once,
    /// at load.
    fn put_packed(
        &self,
        b: usize,
        values: &[f32],
        packed: BufId,
        staging: &HostArena,
    ) -> Result<(), ExecError> {
        let precision = self.plan.shape.precision;
        let quant = self
            .model
            .quant_block(b, self.plan.shape.device_dtype())
            .expect("a packed block is quantised");
        let mut image = vec![0u8; quant.bytes()];
        quant.pack(values, &|x| round_to(precision, x), &mut image);
        let fill = |start: usize, out: &mut [u8]| {
            out.copy_from_slice(&image[start..start + out.len()]);
        };
        self.put_home(staging, image.len(), 1, &fill, packed, None)
    }

    /// The elements of block `b` in this rank's shard (all of them alone).
    fn shard_part(&self, b: usize) -> std::ops::Range<usize> {
        let len = self.model.blocks()[b].len;
        let (lo, _, valid) = self.shard(b);
        lo.min(len)..lo.min(len) + valid
    }

    /// Block `b` whole, from every rank's `shard` of it (rank order; a collective).
    fn gather_block(&self, b: usize, shard: &[f32]) -> Result<Vec<f32>, ExecError> {
        let ranks = self.comm.size();
        let mut all = vec![0f32; ranks * shard.len()];
        self.comm
            .all_gather(bytes_of(shard), bytes_of_mut(&mut all))
            .map_err(|source| ExecError::Comm {
                op: format!("gathering block {b}"),
                source,
            })?;
        all.truncate(self.model.blocks()[b].len);
        Ok(all)
    }

    /// Writes the first `bytes` of home buffer `home` (device, host or NVMe), each byte
    /// range `[start, start + out.len())` being what `fill(start, out)` writes (ranges
    /// start at multiples of `elem` bytes and hold whole elements): in place in the host
    /// arena; through `staging`, a piece at a time, to the device (`convert`: from one
    /// dtype to another as it is copied); from one aligned buffer to NVMe.
    fn put_home(
        &self,
        staging: &HostArena,
        bytes: usize,
        elem: usize,
        fill: &dyn Fn(usize, &mut [u8]),
        home: BufId,
        convert: Option<(Dtype, Dtype)>,
    ) -> Result<(), ExecError> {
        let name = &self.plan.buffer(home).name;
        match self.plan.buffer(home).tier {
            Tier::Device => {
                let dst = self.device_range(home);
                let piece = (staging.len_bytes() / elem.max(1)) * elem;
                let mut start = 0;
                while start < bytes {
                    let n = piece.min(bytes - start);
                    let src = HostRange::new(0, n);
                    fill(
                        start,
                        &mut staging
                            .write(Lane::Cpu, src)
                            .map_err(self.device_error("loading"))?,
                    );
                    let to = match convert {
                        Some((a, b)) => DeviceRange::new(
                            dst.offset_bytes + start / a.size() * b.size(),
                            n / a.size() * b.size(),
                        ),
                        None => DeviceRange::new(dst.offset_bytes + start, n),
                    };
                    self.device
                        .copy_to_device(staging, src, to, convert, &[])
                        .and_then(|e| e.wait())
                        .map_err(self.device_error(format!("loading {name}")))?;
                    start += n;
                }
                Ok(())
            }
            Tier::Host => {
                let mut to = self
                    .host()
                    .write(Lane::Cpu, self.host_range(home).prefix(bytes))
                    .map_err(self.device_error(format!("loading {name}")))?;
                fill(0, &mut to);
                Ok(())
            }
            Tier::Nvme => {
                let mut buf = AlignedBuf::zeroed(bytes.next_multiple_of(4096));
                fill(0, &mut buf.as_mut_slice()[..bytes]);
                let (r, _) = self.write_extent(home, buf)?.wait();
                r.map_err(|source| ExecError::Storage {
                    op: format!("writing {name}"),
                    source,
                })
            }
        }
    }

    /// Reads the master parameters and AdamW's m and v of every block from their homes.
    /// With ranks it is a collective: every rank calls it, and every rank gets the
    /// whole state (its shards gathered).
    pub fn export(&self) -> Result<TrainingState, ExecError> {
        let (sp, sm, sv) = self.export_shard()?;
        let ranks = self.comm.size();
        if ranks == 1 {
            return Ok((sp, sm, sv));
        }
        let (mut p, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (b, block) in self.model.blocks().iter().enumerate() {
            let shard = self.plan.shard_len[b] as usize;
            // Every rank's shard, in rank order: rank r's (master, m, v) of `shard` each.
            let mut mine = Vec::with_capacity(3 * shard);
            for class in [&sp[b], &sm[b], &sv[b]] {
                mine.extend_from_slice(class);
            }
            let mut all = vec![0f32; ranks * 3 * shard];
            self.comm
                .all_gather(bytes_of(&mine), bytes_of_mut(&mut all))
                .map_err(|source| ExecError::Comm {
                    op: format!(
                        "gathering {}",
                        self.plan.buffer(self.plan.block_homes[b].state).name
                    ),
                    source,
                })?;
            let class = |c: usize| -> Vec<f32> {
                let mut out = Vec::with_capacity(ranks * shard);
                for r in 0..ranks {
                    let at = (3 * r + c) * shard;
                    out.extend_from_slice(&all[at..at + shard]);
                }
                out.truncate(block.len);
                out
            };
            p.push(class(0));
            m.push(class(1));
            v.push(class(2));
        }
        Ok((p, m, v))
    }

    /// Reads this rank's shard of the master parameters and AdamW's m and v of every
    /// block from their homes: per block, [`Executor::shard`]'s length of each, zero past
    /// the block's end (alone: the whole blocks). Not a collective.
    pub fn export_shard(&self) -> Result<TrainingState, ExecError> {
        let (mut p, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let mut staging = None;
        for b in 0..self.model.blocks().len() {
            let shard = self.plan.shard_len[b] as usize;
            let mut f = self.read_state(b, 3, &mut staging)?;
            v.push(f.split_off(2 * shard));
            m.push(f.split_off(shard));
            p.push(f);
        }
        Ok((p, m, v))
    }

    /// Block `b`'s master parameters, read from their home: one block of what
    /// [`Executor::export`] returns, for writing or evaluating a model a block at a time.
    /// With ranks a collective: every rank calls it for the same block, reads its shard
    /// and gets the block whole (the shards gathered); [`Executor::with_whole_blocks`]
    /// lets one rank choose the blocks.
    pub fn export_block(&self, b: usize) -> Result<Vec<f32>, ExecError> {
        let len = self.check_block(b)?;
        if self.model.blocks()[b].frozen > 0 {
            return Err(ExecError::BadInput(format!(
                "block {b} has a frozen base (a LoRA model), whose master parameters cover \
                 the adapters alone: read them with export_trained"
            )));
        }
        let mut f = self.read_state(b, 1, &mut None)?;
        if self.comm.size() > 1 {
            return self.gather_block(b, &f);
        }
        f.truncate(len);
        Ok(f)
    }

    /// The master parameters of block `b`'s trained elements
    /// ([`BlockLayout::trained`](crate::model::BlockLayout::trained): a LoRA model's
    /// adapters), read from their home. Alone only.
    pub fn export_trained(&self, b: usize) -> Result<Vec<f32>, ExecError> {
        self.check_block(b)?;
        if self.comm.size() != 1 {
            return Err(ExecError::BadInput(
                "export_trained reads one process's blocks".into(),
            ));
        }
        let mut f = self.read_state(b, 1, &mut None)?;
        f.truncate(self.model.blocks()[b].trained_len());
        Ok(f)
    }

    /// Runs `use_blocks` on rank 0 with a reader of whole blocks' master parameters (any
    /// block, in any order, as often as it asks), while every other rank serves the
    /// blocks it asks for ([`Executor::export_block`]) until it returns: a model written
    /// or evaluated a block at a time, with ranks as alone, one whole block in memory at
    /// a time. A collective: every rank calls it; rank 0 gets what `use_blocks`
    /// returned, the others `None`. Alone, `use_blocks` reads with `export_block`.
    pub fn with_whole_blocks<R>(
        &self,
        use_blocks: impl FnOnce(&dyn Fn(usize) -> Result<Vec<f32>, ExecError>) -> R,
    ) -> Result<Option<R>, ExecError> {
        // Rank 0 names each block it wants, then that no more are wanted.
        const DONE: u64 = u64::MAX;
        let word = |w: u64| -> Result<u64, ExecError> {
            let mut bytes = w.to_le_bytes();
            self.comm
                .broadcast(0, &mut bytes)
                .map_err(|source| ExecError::Comm {
                    op: "naming the next block to gather".into(),
                    source,
                })?;
            Ok(u64::from_le_bytes(bytes))
        };
        if self.comm.size() == 1 {
            return Ok(Some(use_blocks(&|b| self.export_block(b))));
        }
        if self.comm.rank() == 0 {
            let read = |b: usize| {
                self.check_block(b)?; // refused here: the others are asked for blocks only
                word(b as u64)?;
                self.export_block(b)
            };
            let got = use_blocks(&read);
            word(DONE)?;
            return Ok(Some(got));
        }
        loop {
            match word(0)? {
                DONE => return Ok(None),
                b => drop(self.export_block(b as usize)?),
            }
        }
    }

    /// Block `b`'s master parameters, m and v, read from their home: one block of what
    /// [`Executor::export`] returns, for a checkpoint written a block at a time. RAM: the
    /// three buffers returned, and while reading a copy of them (an NVMe read's buffer,
    /// or host staging for device-homed state), 24 bytes × the block's parameters in
    /// all. Alone only (with ranks each lends its shard, [`Executor::with_shard_state`]).
    pub fn export_block_state(&self, b: usize) -> Result<[Vec<f32>; 3], ExecError> {
        self.with_block_state(b, |state| state.map(<[f32]>::to_vec))
    }

    /// Block `b`'s master parameters, m and v (each the length of its trained elements:
    /// the block's, but a LoRA model's adapters alone) lent to `use_state` where their
    /// home's read puts them: the host arena itself, the NVMe
    /// read's buffer, or a staging for device-homed state; no other copy is made (a
    /// checkpoint's writer takes them so). Alone only, as [`Self::export_block_state`].
    pub fn with_block_state<R>(
        &self,
        b: usize,
        use_state: impl FnOnce([&[f32]; 3]) -> R,
    ) -> Result<R, ExecError> {
        if self.comm.size() != 1 {
            return Err(ExecError::BadInput(format!(
                "reading a block's state reads one process's blocks; with {} ranks, each \
                 lends its shard (with_shard_state)",
                self.comm.size()
            )));
        }
        self.check_block(b)?;
        self.lend_state(b, self.model.blocks()[b].trained_len(), use_state)
    }

    /// This rank's shard of block `b`'s master parameters, m and v
    /// ([`Executor::shard`]'s length each, zero past the block's end), lent to
    /// `use_state` as [`Executor::with_block_state`] lends a block's: a sharded
    /// checkpoint written a block at a time. Not a collective.
    pub fn with_shard_state<R>(
        &self,
        b: usize,
        use_state: impl FnOnce([&[f32]; 3]) -> R,
    ) -> Result<R, ExecError> {
        self.check_block(b)?;
        self.lend_state(b, self.plan.shard_len[b] as usize, use_state)
    }

    /// The first `len` values of each of this rank's three classes of block `b`'s state,
    /// lent to `use_state` where their home's read puts them.
    fn lend_state<R>(
        &self,
        b: usize,
        len: usize,
        use_state: impl FnOnce([&[f32]; 3]) -> R,
    ) -> Result<R, ExecError> {
        self.with_state(b, 3, &mut None, |bytes| {
            self.state_as_f32(b, bytes, |[p, m, v]| {
                use_state([&p[..len], &m[..len], &v[..len]])
            })
        })
    }

    /// Hands `use_state` block `b`'s master parameters, m and v (this rank's shard of
    /// each) from `bytes`, its whole state buffer as [`Self::with_state`] lends it: views
    /// of them (fp32 moments), or the moments converted to f32 here (8 bytes per
    /// parameter more).
    fn state_as_f32<R>(
        &self,
        b: usize,
        bytes: &[u8],
        use_state: impl FnOnce([&[f32]; 3]) -> R,
    ) -> R {
        let layout = self.state_layout(b);
        let master = cast::<f32>(&bytes[layout.master()]);
        if layout.format.is_fp32() {
            let [m, v] = layout.moments().map(|r| cast::<f32>(&bytes[r]));
            return use_state([master, m, v]);
        }
        let [m, v] = decode_moments(layout, bytes);
        use_state([master, &m, &v])
    }

    /// Block `b`'s length, when `b` is one of the model's blocks.
    fn check_block(&self, b: usize) -> Result<usize, ExecError> {
        match self.model.blocks().get(b) {
            Some(block) => Ok(block.len),
            None => Err(ExecError::BadInput(format!(
                "block {b} is not one of the model's {}",
                self.model.blocks().len()
            ))),
        }
    }

    /// The first `classes` of this rank's shard of block `b`'s master parameters, m and
    /// v, as f32 (1: the master parameters alone; 3: all three, one after another, the
    /// moments converted from their format), read from their home (`staging`: host
    /// memory for device-homed state, made when first needed, remade larger when a read
    /// needs more, and kept for the next call).
    fn read_state(
        &self,
        b: usize,
        classes: usize,
        staging: &mut Option<HostArena>,
    ) -> Result<Vec<f32>, ExecError> {
        let shard = self.plan.shard_len[b] as usize;
        if shard == 0 {
            return Ok(Vec::new()); // a block that trains nothing has no state
        }
        let mut f = vec![0f32; classes * shard];
        self.with_state(b, classes, staging, |bytes| match classes {
            1 => bytes_of_mut(&mut f).copy_from_slice(bytes),
            _ => self.state_as_f32(b, bytes, |all| {
                for (to, from) in f.chunks_mut(shard).zip(all) {
                    to.copy_from_slice(from);
                }
            }),
        })?;
        Ok(f)
    }

    /// `use_bytes` of this rank's shard of block `b`'s state buffer (`classes` 1: the
    /// master parameters at its head alone; 3: the whole buffer, moments in their
    /// format), where they are read to: the NVMe read's buffer (the master parameters
    /// read and verified on their own, the head of the extent checksummed apart), the
    /// host arena itself, or `staging` for device-homed state. No other copy is made.
    fn with_state<R>(
        &self,
        b: usize,
        classes: usize,
        staging: &mut Option<HostArena>,
        use_bytes: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ExecError> {
        let shard = self.plan.shard_len[b] as usize;
        let home = self.plan.block_homes[b].state;
        let name = &self.plan.buffer(home).name;
        let bytes = match classes {
            1 => 4 * shard,
            _ => self.state_buffer_bytes(b),
        };
        let range = HostRange::new(0, bytes);
        match self.plan.buffer(home).tier {
            Tier::Nvme => {
                let (r, buf) = self
                    .read_extent(
                        home,
                        AlignedBuf::zeroed(bytes.next_multiple_of(4096)),
                        bytes as u64,
                    )?
                    .wait();
                r.map_err(|source| ExecError::Storage {
                    op: format!("reading {name}"),
                    source,
                })?;
                Ok(use_bytes(&buf.as_slice()[..bytes]))
            }
            Tier::Host => {
                let bytes = self
                    .host()
                    .read(Lane::Cpu, self.host_range(home).prefix(bytes))
                    .map_err(self.device_error(format!("reading {name}")))?;
                Ok(use_bytes(&bytes))
            }
            Tier::Device => {
                if staging.as_ref().is_none_or(|s| s.len_bytes() < bytes) {
                    *staging = None; // freed before the larger one is made
                    *staging = Some(self.staging(bytes.next_multiple_of(4096))?);
                }
                let staging = staging.as_ref().expect("made above");
                let src = self.device_range(home);
                self.device
                    .copy_to_host(
                        DeviceRange::new(src.offset_bytes, bytes),
                        staging,
                        range,
                        &[],
                    )
                    .and_then(|e| e.wait())
                    .map_err(self.device_error(format!("reading {name}")))?;
                let bytes = staging
                    .read(Lane::Cpu, range)
                    .map_err(self.device_error("exporting"))?;
                Ok(use_bytes(&bytes))
            }
        }
    }
}

/// `x` padded with zeros to `len` values (a copy, for a shard past the block's end), or
/// `x` itself when it is that long.
fn padded(x: &[f32], len: usize) -> std::borrow::Cow<'_, [f32]> {
    if x.len() == len {
        return x.into();
    }
    let mut p = x.to_vec();
    p.resize(len, 0.0);
    p.into()
}

/// Refuses a block's `buffers` made for loading (its `what`) unless each is the block's
/// `len`.
fn check_block_len(
    b: usize,
    what: &str,
    buffers: &[Vec<f32>],
    len: usize,
) -> Result<(), ExecError> {
    match buffers.iter().find(|x| x.len() != len) {
        Some(x) => Err(ExecError::BadInput(format!(
            "block {b}'s {what}: {} values, not the model's {len}",
            x.len()
        ))),
        None => Ok(()),
    }
}

/// `values` rounded to `precision`'s working dtype, kept in f32.
fn round_to(precision: Precision, values: &mut [f32]) {
    match precision {
        Precision::Fp32 => {}
        Precision::Bf16 => values
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        Precision::Fp16 => values
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
    }
}

/// The working copy of `master` in `precision`, rounded to nearest even, into `out`.
pub(super) fn write_working(precision: Precision, master: &[f32], out: &mut [u8]) {
    let cpu = Cpu::default();
    match precision {
        Precision::Fp32 => cast_mut::<f32>(out).copy_from_slice(master),
        Precision::Bf16 => {
            strata_kernels::ops::f32_to_bf16(&cpu, cast_mut::<half::bf16>(out), master)
        }
        Precision::Fp16 => {
            strata_kernels::ops::f32_to_f16(&cpu, cast_mut::<half::f16>(out), master)
        }
    }
}
