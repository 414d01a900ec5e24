//! The IPv4 table (`ratelimit_common::v4_table`) as user space sees it: the pinned array mapped
//! into this process's memory, so an install rewrites the 65,536 words of a trie half with plain
//! stores rather than one system call each.
//!
//! Each word is read by the XDP program with one aligned 32-bit load and written here with one
//! atomic store, so a packet sees a word whole, old or new. The agent writes only the half no
//! packet reads (see `Dataplane::install`), as it does the trie's.

use std::{
    io,
    os::fd::BorrowedFd,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
};

use ratelimit_common::v4_table;

use super::store::SharedMapping;

/// The IPv4 table's words, mapped.
pub struct MappedTable {
    mapping: Arc<SharedMapping>,
}

/// The whole map: its entries lie back to back (64 bytes each, a multiple of the kernel's 8).
const BYTES: usize = v4_table::ENTRIES as usize * size_of::<v4_table::Entry>();

impl MappedTable {
    /// Maps the table behind `fd` (map id `id`, of [`v4_table::ENTRIES`] entries: the caller
    /// checked the map's shape), writable if the descriptor allows (one mapping per process, see
    /// `SharedMapping::shared`).
    pub fn map(fd: BorrowedFd<'_>, id: u32) -> io::Result<Self> {
        Ok(Self {
            mapping: SharedMapping::shared(fd, id, BYTES)?,
        })
    }

    fn word(&self, generation: u8, slot: usize) -> &AtomicU32 {
        let i = usize::from(generation & 1) * v4_table::SLOTS as usize + slot;
        assert!(
            i < 2 * v4_table::SLOTS as usize,
            "IPv4 table index {i} out of range"
        );
        // SAFETY: in bounds of the mapping (checked above), which lives as long as `self`;
        // `AtomicU32` has the layout of the `u32` words the program reads.
        unsafe { &*self.mapping.ptr().cast::<AtomicU32>().add(i) }
    }

    /// The words of trie half `generation`, by /16.
    #[must_use]
    pub fn half(&self, generation: u8) -> Vec<u32> {
        (0..v4_table::SLOTS as usize)
            .map(|s| self.word(generation, s).load(Ordering::Relaxed))
            .collect()
    }

    /// Makes trie half `generation` hold `words` (one per /16, [`v4_table::SLOTS`] of them),
    /// storing only the words that differ, and returns how many did. Whatever the half held
    /// (a crashed install's half-written words included) is compared, not assumed.
    ///
    /// # Panics
    /// If `words` is not one word per /16, or the table is mapped read-only.
    pub fn write_half(&self, generation: u8, words: &[u32]) -> usize {
        assert_eq!(words.len(), v4_table::SLOTS as usize, "one word per /16");
        self.mapping.require_writable("the IPv4 table");
        let mut changed = 0;
        for (s, &w) in words.iter().enumerate() {
            let word = self.word(generation, s);
            if word.load(Ordering::Relaxed) != w {
                word.store(w, Ordering::Release);
                changed += 1;
            }
        }
        changed
    }
}
