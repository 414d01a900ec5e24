//! Where the cluster sync finds keys it has not published
//! (`ratelimit_common::map_names::NEW_PAGES`), mapped: the grown slots (buckets of
//! cluster-scoped limits whose count just passed a power of two) and the flags of the bucket
//! store's pages where the program created a bucket of such a limit. The sync takes both every
//! round and reads only those records and pages.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ratelimit_common::{BUCKET_PAGE_RECORDS, GROWN_SLOTS};

use super::store::SharedMapping;

/// The grown slots' and the page flags' words, mapped.
pub struct MappedNewPages {
    mapping: Arc<SharedMapping>,
    words: u32,
}

impl MappedNewPages {
    /// Maps the `words` words behind `fd` (map id `id`; the caller checked the map's shape: the
    /// [`GROWN_SLOTS`] and at least one word of flags), writable if the descriptor allows (one
    /// mapping per process, see `SharedMapping::shared`).
    pub fn map(fd: BorrowedFd<'_>, id: u32, words: u32) -> io::Result<Self> {
        Ok(Self {
            mapping: SharedMapping::shared(fd, id, words.max(1) as usize * 8)?,
            words,
        })
    }

    fn word(&self, i: u32) -> &AtomicU64 {
        assert!(i < self.words, "page flag word {i} out of {}", self.words);
        // SAFETY: an 8-aligned word in bounds of the mapping, which lives as long as `self`;
        // `AtomicU64` has the layout of the program's `u64` words.
        unsafe { &*self.mapping.ptr().cast::<AtomicU64>().add(i as usize) }
    }

    /// Takes the flags: every flagged page's first record, in store order, its flag cleared (one
    /// swap per word that has any). A page the program flags again meanwhile stays flagged for
    /// the next take; the program flags after publishing the record, so a page taken here shows
    /// its new bucket to a read that follows.
    #[must_use]
    pub fn take(&self) -> Vec<u32> {
        let mut firsts = Vec::new();
        let _ = self.take_from(0, || true, |first| firsts.push(first));
        firsts
    }

    /// [`MappedNewPages::take`] from flag word `start` on (0: the first page's), handing `f`
    /// each flagged page's first record as its word is taken, while `go_on()` (asked before
    /// each word that has a flag): the word to go on from next time if it stopped, `None` once
    /// it reached the end.
    pub fn take_from(
        &self,
        start: u32,
        mut go_on: impl FnMut() -> bool,
        mut f: impl FnMut(u32),
    ) -> Option<u32> {
        for w in start..self.words.saturating_sub(GROWN_SLOTS) {
            let word = self.word(GROWN_SLOTS + w);
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            if !go_on() {
                return Some(w);
            }
            let mut bits = word.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let bit = bits.trailing_zeros();
                bits &= bits - 1;
                f((w * 64 + bit) * BUCKET_PAGE_RECORDS);
            }
        }
        None
    }

    /// Leaves `entry` in grown slot `slot` as the program would ([`ratelimit_common::grown_entry`];
    /// for tests: another record's mark, heavier or lighter).
    pub fn put_grown(&self, slot: u32, entry: u64) {
        assert!(slot < GROWN_SLOTS, "grown slot {slot} out of {GROWN_SLOTS}");
        self.word(slot).store(entry, Ordering::Release);
    }

    /// Whether any page is flagged (for tests).
    #[must_use]
    pub fn any(&self) -> bool {
        (GROWN_SLOTS..self.words).any(|w| self.word(w).load(Ordering::Relaxed) != 0)
    }

    /// Takes the grown slots: each record left in one ([`ratelimit_common::grown_entry`]) and
    /// its count then, the slot emptied (one swap per slot that holds one). At most
    /// [`GROWN_SLOTS`] records, whatever happens meanwhile; a record the program leaves again
    /// after its slot's swap waits for the next take.
    #[must_use]
    pub fn take_grown(&self) -> Vec<(u32, u32)> {
        let mut grown = Vec::new();
        for w in 0..GROWN_SLOTS.min(self.words) {
            let word = self.word(w);
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let e = word.swap(0, Ordering::AcqRel);
            if e != 0 {
                #[expect(clippy::cast_possible_truncation, reason = "the entry's two halves")]
                grown.push((e as u32, (e >> 32) as u32));
            }
        }
        grown
    }
}
