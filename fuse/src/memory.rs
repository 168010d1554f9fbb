//! A [`Backend`] over plain memory. The `fuse-memory` example serves it as
//! the floor of the client's kernel path (`make bench-client` swaps through
//! it to show what the kernel, FUSE and a loop device cost with no donor
//! behind them), and the crate's tests serve it to check the protocol and
//! the transports against bytes that are really kept.

use std::sync::Mutex;

use netpager_util::LockExt;

use crate::Backend;

/// Bytes per lock: requests of different chunks never wait on each other.
const CHUNK: usize = 64 << 10;

/// `size` bytes in chunks of [`CHUNK`], each behind its own lock. A trim
/// zeroes (memory has nothing to give back); a flush has nothing to do.
/// Ranges are within the size: the [`Session`](crate::Session) refuses
/// the others before they reach a backend.
pub struct Memory {
    chunks: Vec<Mutex<Box<[u8]>>>,
    size: usize,
}

impl Memory {
    /// `size` bytes, each `fill`. A non-zero fill writes every page now,
    /// so the memory is really there (and locked, under mlockall).
    pub fn new(size: usize, fill: u8) -> Memory {
        let chunks = (0..size.div_ceil(CHUNK))
            .map(|c| {
                let len = CHUNK.min(size - c * CHUNK);
                Mutex::new(vec![fill; len].into_boxed_slice())
            })
            .collect();
        Memory { chunks, size }
    }

    /// Calls `f(chunk, offset in chunk, offset in request, length)` for
    /// each chunk the range touches.
    fn each(&self, offset: u64, len: usize, mut f: impl FnMut(&mut [u8], usize, usize, usize)) {
        let mut done = 0;
        while done < len {
            let pos = offset as usize + done;
            let (c, at) = (pos / CHUNK, pos % CHUNK);
            let n = (CHUNK - at).min(len - done);
            let mut chunk = self.chunks[c].lock_or_recover();
            f(&mut chunk, at, done, n);
            done += n;
        }
    }
}

impl Backend for Memory {
    fn size(&self) -> u64 {
        self.size as u64
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        self.each(offset, buf.len(), |c, at, i, n| {
            buf[i..i + n].copy_from_slice(&c[at..at + n])
        });
        Ok(())
    }
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
        self.each(offset, data.len(), |c, at, i, n| {
            c[at..at + n].copy_from_slice(&data[i..i + n])
        });
        Ok(())
    }
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.each(offset, len as usize, |c, at, _, n| c[at..at + n].fill(0));
        Ok(())
    }
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.zero(len, offset)
    }
    fn flush(&self) -> Result<(), i32> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_across_chunks_up_to_a_short_last_chunk() {
        let size = 2 * CHUNK + 100;
        let m = Memory::new(size, 0xa5);
        assert_eq!(m.size(), size as u64);
        // From 100 bytes before the first chunk's end to the very end.
        let at = CHUNK - 100;
        let data: Vec<u8> = (0..size - at).map(|i| i as u8 ^ 0x3c).collect();
        m.write(&data, at as u64).unwrap();
        let mut back = vec![0u8; size];
        m.read(&mut back, 0).unwrap();
        assert!(back[..at].iter().all(|&c| c == 0xa5));
        assert_eq!(back[at..], data);
        m.trim(CHUNK as u64, at as u64 + 50).unwrap();
        m.read(&mut back, 0).unwrap();
        assert_eq!(back[at..at + 50], data[..50]);
        assert!(back[at + 50..at + 50 + CHUNK].iter().all(|&c| c == 0));
        assert_eq!(back[at + 50 + CHUNK..], data[50 + CHUNK..]);
    }
}
