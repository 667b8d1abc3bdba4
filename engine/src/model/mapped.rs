//! Files read through a read-only memory map (token files and their masks, text to
//! tokenize, safetensors weights): the one place the engine maps a file, so the argument
//! for doing so is made once.
//!
//! Not here: what the bytes mean (`data`, `tokenize`, `weights` check them).

use std::fs::File;

use memmap2::{Mmap, UncheckedAdvice};

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

/// Hands the pages under `bytes`, a part of `map`, back to the kernel once they are read
/// (MADV_DONTNEED), so that reading a file through its map a part at a time does not
/// leave the whole file resident in this process: a model's weights read a block at a
/// time would otherwise count every byte of the file in the process's memory by the
/// last block. Pages shared with a neighbouring part are read again if touched. A
/// no-op when `bytes` is not inside `map` or the kernel declines (it is advice).
pub(crate) fn release(map: &Mmap, bytes: &[u8]) {
    let start = map.as_ptr() as usize;
    let Some(offset) = (bytes.as_ptr() as usize).checked_sub(start) else {
        return;
    };
    if bytes.is_empty() || offset + bytes.len() > map.len() {
        return;
    }
    // SAFETY: `map` is a read-only shared mapping of a file (`map_read_only`): dropping
    // its pages loses nothing, as the next read faults them in from the file again with
    // the same bytes (MADV_DONTNEED changes what a read sees only for private or
    // anonymous memory). The range lies inside the map, checked above; no reference into
    // it is invalidated, since the memory stays mapped.
    let _ = unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, offset, bytes.len()) };
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// The resident bytes of the mapping that starts at `addr`, from /proc/self/smaps.
    fn resident_bytes(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(line) = lines.next() {
            let range = line.split_whitespace().next().unwrap_or("");
            let Some((start, _)) = range.split_once('-') else {
                continue;
            };
            if usize::from_str_radix(start, 16) != Ok(addr) {
                continue;
            }
            let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
            let kib: u64 = rss.split_whitespace().nth(1).unwrap().parse().unwrap();
            return kib * 1024;
        }
        panic!("no mapping at {addr:#x}");
    }

    #[test]
    fn released_pages_leave_the_process_and_read_back_the_same() {
        let mut file = tempfile::tempfile().unwrap();
        let len = 16 << 20;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        let map = map_read_only(&file).unwrap();
        let sum = |m: &[u8]| m.iter().map(|&b| b as u64).sum::<u64>();
        let expected = sum(&map);
        let addr = map.as_ptr() as usize;
        assert!(resident_bytes(addr) >= len as u64 / 2, "read, so resident");
        release(&map, &map[..]);
        assert!(resident_bytes(addr) < 1 << 20, "released");
        assert_eq!(sum(&map), expected, "read back from the file");
        // A slice from elsewhere is not this map's to release.
        release(&map, &bytes[..]);
    }
}
