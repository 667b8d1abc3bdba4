//! The built-in model, GPT-2: an ordered list of blocks (embedding, N transformer
//! blocks, head), each with forward, backward that recomputes its forward from its
//! saved input, and one flat parameter buffer carved into tensors.
//!
//! - [`Gpt2Config`]: the shape, from `tiny` to multi-billion-parameter sizes.
//! - [`layout`]: the blocks and the place of every tensor in its block's buffer.
//! - [`block`]: each block's math, written once against a [`Backend`] (the CPU here,
//!   CUDA in [`cuda`]).
//! - [`Model`]: the blocks in order, and a whole forward and backward pass for when every
//!   block's buffers are resident (evaluation, tests, the all-on-device policy).
//! - [`weights`]: Hugging Face `model.safetensors` + `config.json`, loaded through
//!   memmap2 and saved in the same form.
//! - [`data`]: token files (llm.c's `.bin`, or raw bytes) and the batching rule.
//!
//! Where buffers live between blocks, and when they move, is not decided here.

pub mod backend;
pub mod block;
mod config;
pub mod cuda;
pub mod data;
mod error;
mod init;
pub mod layout;
pub mod weights;

pub use backend::{Backend, CpuBackend, Dims, HostParams};
pub use block::BlockScratch;
pub use config::{Gpt2Config, PRESETS};
pub use error::ModelError;
pub use layout::{BlockKind, BlockLayout, Slot, TensorSpec};

use layout::{EmbeddingSlots, HeadSlots, TransformerSlots};

/// GPT-2: its shape and the layout of its blocks. Holds no parameters: those are one
/// buffer per block, wherever the caller keeps them (`Vec<f32>` on the host, a device
/// buffer of a [`Backend`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    config: Gpt2Config,
    blocks: Vec<BlockLayout>,
    embedding: EmbeddingSlots,
    transformer: Option<TransformerSlots>,
    head: HeadSlots,
}

/// What a whole forward pass keeps for the backward pass (the input of every block
/// after the embedding: activation checkpoints) and the buffers the blocks run in, for
/// one batch shape on one backend.
pub struct Workspace<B: Backend> {
    dims: Dims,
    /// `checkpoints[i]`: input of transformer block i; `checkpoints[layers]`: the head's.
    checkpoints: Vec<B::Act>,
    /// The running block's activations; after a forward pass, the head's logits and
    /// per-position losses.
    pub scratch: BlockScratch<B>,
    tokens: B::Tokens,
    targets: B::Tokens,
    grad_a: B::Act,
    grad_b: B::Act,
    has_forward: bool,
}

impl<B: Backend> Workspace<B> {
    /// The batch shape this workspace is sized for.
    pub fn dims(&self) -> Dims {
        self.dims
    }
}

impl Model {
    /// The model of shape `config`.
    pub fn new(config: Gpt2Config) -> Result<Self, ModelError> {
        config.validate()?;
        let blocks = layout::block_layouts(&config);
        let last = blocks.len() - 1;
        Ok(Model {
            config,
            embedding: EmbeddingSlots::of(&blocks[0]),
            transformer: (config.layers > 0).then(|| TransformerSlots::of(&blocks[1])),
            head: HeadSlots::of(&blocks[last]),
            blocks,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// The blocks, in forward order: embedding, transformer blocks, head.
    pub fn blocks(&self) -> &[BlockLayout] {
        &self.blocks
    }

    /// Which block holds the tensor called `name` (Hugging Face's name without
    /// `transformer.`), and where.
    pub fn find_tensor(&self, name: &str) -> Option<(usize, &TensorSpec)> {
        self.blocks
            .iter()
            .enumerate()
            .find_map(|(i, b)| b.tensor(name).map(|t| (i, t)))
    }

    /// One zeroed f32 buffer per block.
    pub fn zero_params(&self) -> Vec<Vec<f32>> {
        self.blocks.iter().map(|b| vec![0.0; b.len]).collect()
    }

    /// Parameters initialised as GPT-2 is for training from scratch (Hugging Face's
    /// rule): weights and embeddings normal with deviation 0.02, the residual
    /// projections' 0.02 / sqrt(2 layers), biases 0, LayerNorm weights 1. Deterministic
    /// in `seed`.
    pub fn init_params(&self, seed: u64) -> Vec<Vec<f32>> {
        init::gpt2_init(self, seed)
    }

    /// Zeroed gradient buffers, one per block, on `backend`.
    pub fn alloc_grads<B: Backend>(&self, backend: &B) -> Result<Vec<B::Grads>, ModelError> {
        self.blocks
            .iter()
            .map(|b| backend.alloc_grads(b.len))
            .collect()
    }

    /// The batch dimensions for `batch` sequences of `seq` tokens, checked against the
    /// model's context.
    pub fn dims(&self, batch: usize, seq: usize) -> Result<Dims, ModelError> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::BadInput(
                "batch and sequence length must be at least 1".into(),
            ));
        }
        if seq > self.config.ctx {
            return Err(ModelError::BadInput(format!(
                "sequence length {seq} exceeds the model's context of {} tokens",
                self.config.ctx
            )));
        }
        // The largest buffers a batch needs: logits (rows x vocab), the MLP's activations
        // (rows x 4C), attention scores (B x heads x T x T). Their sizes must fit.
        let c = self.config;
        let fits = batch
            .checked_mul(seq)
            .and_then(|rows| {
                rows.checked_mul(c.vocab)?;
                rows.checked_mul(4)?.checked_mul(c.width)
            })
            .and_then(|_| {
                batch
                    .checked_mul(c.heads)?
                    .checked_mul(seq)?
                    .checked_mul(seq)
            });
        if fits.is_none() {
            return Err(ModelError::BadInput(format!(
                "a batch of {batch} x {seq} tokens is too large: its activations would have \
                 more elements than this machine can address"
            )));
        }
        Ok(Dims {
            batch,
            seq,
            width: self.config.width,
            heads: self.config.heads,
            vocab: self.config.vocab,
        })
    }

    /// Buffers for forward and backward passes over batches of `batch` × `seq` tokens.
    pub fn workspace<B: Backend>(
        &self,
        backend: &B,
        batch: usize,
        seq: usize,
    ) -> Result<Workspace<B>, ModelError> {
        let dims = self.dims(batch, seq)?;
        let (n, c) = (dims.rows(), dims.width);
        Ok(Workspace {
            dims,
            checkpoints: (0..=self.config.layers)
                .map(|_| backend.alloc_act(n * c))
                .collect::<Result<_, _>>()?,
            scratch: BlockScratch::new(backend, dims)?,
            tokens: backend.alloc_tokens(n)?,
            targets: backend.alloc_tokens(n)?,
            grad_a: backend.alloc_act(n * c)?,
            grad_b: backend.alloc_act(n * c)?,
            has_forward: false,
        })
    }

    /// Errors naming the first id of `tokens` outside the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().position(|&t| t as usize >= self.config.vocab) {
            Some(position) => Err(ModelError::TokenOutOfVocab {
                origin: "the batch given".into(),
                position: position as u64,
                token: tokens[position],
                vocab: self.config.vocab,
            }),
            None => Ok(()),
        }
    }

    fn check_params<T>(&self, params: &[T]) -> Result<(), ModelError> {
        if params.len() != self.blocks.len() {
            return Err(ModelError::BadInput(format!(
                "{} parameter buffers given for {} blocks",
                params.len(),
                self.blocks.len()
            )));
        }
        Ok(())
    }

    fn layer_slots(&self) -> &TransformerSlots {
        self.transformer
            .as_ref()
            .expect("a model with layers has their slots")
    }

    /// Block by block (for an executor that moves each block's buffers itself): the
    /// embedding's forward, `out` = `wte[tokens]` + `wpe`.
    pub fn embedding_forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Params,
        tokens: &B::Tokens,
        out: &mut B::Act,
        dims: Dims,
    ) -> Result<(), ModelError> {
        block::embedding_forward(be, &self.embedding, params, tokens, out, dims)
    }

    /// Block by block: transformer layer `layer`'s forward from `x` into `out`.
    pub fn layer_forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Params,
        x: &B::Act,
        out: &mut B::Act,
        scratch: &mut BlockScratch<B>,
    ) -> Result<(), ModelError> {
        block::transformer_forward(be, self.layer_slots(), params, x, out, scratch)
    }

    /// Block by block: the head's forward (logits and per-position losses into
    /// `scratch`), with the embedding's buffer for the tied `wte`.
    pub fn head_forward<B: Backend>(
        &self,
        be: &B,
        head: &B::Params,
        embedding: &B::Params,
        x: &B::Act,
        targets: &B::Tokens,
        scratch: &mut BlockScratch<B>,
    ) -> Result<(), ModelError> {
        let wte = self.embedding.wte;
        block::head_forward(be, &self.head, head, embedding, wte, x, targets, scratch)
    }

    /// Block by block: the head's backward right after its forward on the same
    /// `scratch`; accumulates into `head_grads` and (tied `wte`) `embedding_grads`, and
    /// writes the gradient of `x` into `dx`. `dloss` is the gradient of the loss
    /// with respect to each position's loss.
    #[allow(clippy::too_many_arguments)]
    pub fn head_backward<B: Backend>(
        &self,
        be: &B,
        head: &B::Params,
        head_grads: &mut B::Grads,
        embedding: &B::Params,
        embedding_grads: &mut B::Grads,
        x: &B::Act,
        targets: &B::Tokens,
        dloss: f32,
        dx: &mut B::Act,
        scratch: &mut BlockScratch<B>,
    ) -> Result<(), ModelError> {
        block::head_backward(
            be,
            &self.head,
            head,
            head_grads,
            embedding,
            embedding_grads,
            self.embedding.wte,
            x,
            targets,
            dloss,
            dx,
            scratch,
        )
    }

    /// Block by block: layer backward, recomputing its forward from its input `x`;
    /// accumulates into `grads` and writes the gradient of `x` into `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_backward<B: Backend>(
        &self,
        be: &B,
        params: &B::Params,
        grads: &mut B::Grads,
        x: &B::Act,
        dout: &B::Act,
        dx: &mut B::Act,
        scratch: &mut BlockScratch<B>,
    ) -> Result<(), ModelError> {
        block::transformer_backward(be, self.layer_slots(), params, grads, x, dout, dx, scratch)
    }

    /// Block by block: the embedding's backward, accumulating into `grads`.
    pub fn embedding_backward<B: Backend>(
        &self,
        be: &B,
        grads: &mut B::Grads,
        tokens: &B::Tokens,
        dout: &B::Act,
        dims: Dims,
    ) -> Result<(), ModelError> {
        block::embedding_backward(be, &self.embedding, grads, tokens, dout, dims)
    }

    /// Runs every block forward on `tokens` (B × T, row-major) and returns the mean
    /// cross-entropy against `targets`. Keeps each block's input in `ws` for
    /// [`Model::backward`]; leaves logits and per-position losses in `ws.scratch`.
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        params: &[B::Params],
        ws: &mut Workspace<B>,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f32, ModelError> {
        // Whatever happens below, the workspace no longer holds the forward pass a
        // backward could use.
        ws.has_forward = false;
        self.check_params(params)?;
        let n = ws.dims.rows();
        if tokens.len() != n || targets.len() != n {
            return Err(ModelError::BadInput(format!(
                "{} tokens and {} targets given for a batch of {n}",
                tokens.len(),
                targets.len()
            )));
        }
        self.check_tokens(tokens)?;
        self.check_tokens(targets)?;
        be.upload_tokens(&mut ws.tokens, tokens)?;
        be.upload_tokens(&mut ws.targets, targets)?;
        let dims = ws.dims;
        block::embedding_forward(
            be,
            &self.embedding,
            &params[0],
            &ws.tokens,
            &mut ws.checkpoints[0],
            dims,
        )?;
        for layer in 0..self.config.layers {
            let (done, rest) = ws.checkpoints.split_at_mut(layer + 1);
            let slots = self
                .transformer
                .as_ref()
                .expect("a model with layers has their slots");
            let p = &params[layer + 1];
            block::transformer_forward(be, slots, p, &done[layer], &mut rest[0], &mut ws.scratch)?;
        }
        let last = self.blocks.len() - 1;
        let x = &ws.checkpoints[self.config.layers];
        let wte = self.embedding.wte;
        block::head_forward(
            be,
            &self.head,
            &params[last],
            &params[0],
            wte,
            x,
            &ws.targets,
            &mut ws.scratch,
        )?;
        ws.has_forward = true;
        let losses = be.download_stats(&ws.scratch.losses)?;
        let sum: f64 = losses.iter().map(|&l| l as f64).sum();
        Ok((sum / n as f64) as f32)
    }

    /// After [`Model::forward`] on `ws`, adds to `grads` (one buffer per block) the
    /// gradient of the mean loss. Each block recomputes its forward from its checkpoint.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        params: &[B::Params],
        grads: &mut [B::Grads],
        ws: &mut Workspace<B>,
    ) -> Result<(), ModelError> {
        self.check_params(params)?;
        self.check_params(grads)?;
        if !ws.has_forward {
            return Err(ModelError::BadInput(
                "backward needs a forward pass on this workspace first".into(),
            ));
        }
        let dims = ws.dims;
        let layers = self.config.layers;
        let last = self.blocks.len() - 1;
        let (emb_grads, rest) = grads.split_first_mut().expect("a model has blocks");
        let (head_grads, layer_grads) = rest.split_last_mut().expect("a model has a head");
        let dloss = 1.0 / dims.rows() as f32;
        block::head_backward(
            be,
            &self.head,
            &params[last],
            head_grads,
            &params[0],
            emb_grads,
            self.embedding.wte,
            &ws.checkpoints[layers],
            &ws.targets,
            dloss,
            &mut ws.grad_a,
            &mut ws.scratch,
        )?;
        for layer in (0..layers).rev() {
            let slots = self
                .transformer
                .as_ref()
                .expect("a model with layers has their slots");
            block::transformer_backward(
                be,
                slots,
                &params[layer + 1],
                &mut layer_grads[layer],
                &ws.checkpoints[layer],
                &ws.grad_a,
                &mut ws.grad_b,
                &mut ws.scratch,
            )?;
            std::mem::swap(&mut ws.grad_a, &mut ws.grad_b);
        }
        block::embedding_backward(be, &self.embedding, emb_grads, &ws.tokens, &ws.grad_a, dims)?;
        // The scratch's logits now hold their gradient: a second backward needs a new forward.
        ws.has_forward = false;
        Ok(())
    }
}
