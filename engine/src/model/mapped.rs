//! Files read through a read-only memory map (token files and their masks, text to
//! tokenize, safetensors weights): the one place the engine maps a file, so the argument
//! for doing so is made once.
//!
//! Not here: what the bytes mean (`data`, `tokenize`, `weights` check them).

use std::fs::File;

use memmap2::Mmap;

/// `file`'s bytes, mapped read-only.
///
/// Mapping is `unsafe` because the bytes can change under the map if another process
/// writes or truncates the file meanwhile. strata never writes a file it has mapped; a
/// file changed by someone else may give other bytes, which every reader validates
/// (magic numbers, vocabulary, UTF-8, safetensors headers and lengths), or a fault on a
/// truncated page: the usual caveat of reading through mmap, accepted for loading speed
/// and memory (a token file or a checkpoint is read without a copy).
pub(crate) fn map_read_only(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the map is only read, never written; see above for a file changed under it.
    unsafe { Mmap::map(file) }
}
