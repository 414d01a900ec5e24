//! The bucket store as user space sees it: the pinned array mapped into this process's memory
//! (`BPF_F_MMAPABLE`), so a walk of a million buckets is a read of 64 MiB rather than system calls,
//! and the cluster sync charges a bucket with the same compare-and-swap the XDP program uses.
//!
//! The layout and the rules of the store (sets, the keyed hash, the header word, busy records,
//! the order of eviction) are the program's: see `ratelimit-ebpf/src/store.rs` and
//! `ratelimit_common::{Bucket, bucket_hash, victim_score}`.

use std::{
    collections::HashMap,
    io,
    ops::ControlFlow,
    os::fd::{AsRawFd as _, BorrowedFd},
    sync::{
        atomic::{AtomicU64, AtomicU8, Ordering},
        Arc, Mutex, OnceLock, PoisonError, Weak,
    },
};

use ratelimit_common::{
    addr_words, bucket_candidate, bucket_hash, bucket_header, bucket_sets, record_tag_offset,
    victim_score, Bucket, BucketKey, Rule, VictimChooser, BUCKET_BUSY, BUCKET_CANDIDATES,
    BUCKET_HEADER_OFFSET, BUCKET_WAYS,
};

/// The bucket store's records, mapped.
pub struct MappedStore {
    mapping: Arc<SharedMapping>,
    records: u32,
    /// The records' tags (`ratelimit_common::tags`), a byte a record in lines with the
    /// first-packet slots, where mapped.
    tags: Option<Arc<SharedMapping>>,
}

/// The first `bytes` of a memory-mappable BPF array, mapped shared into this process (read-write
/// if the descriptor allows, else read-only) and unmapped when dropped. The bucket store and the
/// IPv4 table are each one.
pub(super) struct SharedMapping {
    ptr: *mut u8,
    bytes: usize,
    writable: bool,
}

/// The writable mappings this process holds, by map id and length (see [`SharedMapping::shared`]).
type Mappings = Mutex<HashMap<(u32, usize), Weak<SharedMapping>>>;

/// The process's [`Mappings`].
fn mappings() -> &'static Mappings {
    static MAPPINGS: OnceLock<Mappings> = OnceLock::new();
    MAPPINGS.get_or_init(Mutex::default)
}

// SAFETY: the mapping is plain shared memory; every access through it (the store's, the IPv4
// table's) is a volatile copy or an atomic operation, as the XDP program's are.
unsafe impl Send for SharedMapping {}
// SAFETY: as above.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// The first `bytes` of the array behind `fd` (map id `id`), mapped: the mapping this process
    /// already holds of it, if one is writable, else a new one. The agent opens the pinned maps
    /// more than once (its data plane, the bucket census, the cluster sync each have their own
    /// handles, off one another's locks): mapped again each time, the same kernel pages counted
    /// once more in its resident memory for every mapping (a 64 MiB store made an idle agent
    /// 141.5 MiB instead of 74). A live mapping keeps its map alive, so its id names no other map.
    pub(super) fn shared(fd: BorrowedFd<'_>, id: u32, bytes: usize) -> io::Result<Arc<Self>> {
        let mut all = mappings().lock().unwrap_or_else(PoisonError::into_inner);
        all.retain(|_, m| m.strong_count() > 0);
        if let Some(m) = all.get(&(id, bytes)).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let m = Arc::new(Self::map(fd, bytes)?);
        if m.writable {
            all.insert((id, bytes), Arc::downgrade(&m));
        }
        Ok(m)
    }

    /// Maps the first `bytes` of the array behind `fd`.
    fn map(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<Self> {
        let try_map = |prot| {
            // SAFETY: a fresh shared mapping of a BPF array map; the kernel checks the length
            // against the map's size.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    prot,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                Err(io::Error::last_os_error())
            } else {
                Ok(p.cast())
            }
        };
        let (ptr, writable) = match try_map(libc::PROT_READ | libc::PROT_WRITE) {
            Ok(p) => (p, true),
            Err(_) => (try_map(libc::PROT_READ)?, false),
        };
        Ok(Self {
            ptr,
            bytes,
            writable,
        })
    }

    /// The mapping's first byte (page-aligned); valid for `bytes` while `self` lives.
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Panics unless the mapping is writable; `what` names it.
    pub(super) fn require_writable(&self, what: &str) {
        assert!(
            self.writable,
            "{what} is mapped read-only (opened without write access)"
        );
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

/// Where a key's bucket is, or where it would go.
pub enum Slot {
    /// Record `index` holds the key's bucket.
    Found(u32),
    /// The key has no bucket; record `index` (holding `header` now, with `victim_score` score
    /// `score`) is the one a new bucket would take.
    Vacant {
        /// The record.
        index: u32,
        /// Its header word when scanned.
        header: u64,
        /// What taking it loses (`victim_score`).
        score: u64,
    },
    /// Every record of the set is being written.
    Busy,
}

impl MappedStore {
    /// Maps the store behind `fd` (map id `id`, `records` records), writable if the descriptor
    /// allows (see [`SharedMapping::shared`]: one mapping per process).
    pub fn map(fd: BorrowedFd<'_>, id: u32, records: u32) -> io::Result<Self> {
        let bytes = (records as usize * size_of::<Bucket>()).max(1);
        Ok(Self {
            mapping: SharedMapping::shared(fd, id, bytes)?,
            records,
            tags: None,
        })
    }

    /// Maps the records' tags behind `fd` (map id `id`, `lines` lines of
    /// [`ratelimit_common::TAG_LINE_RECORDS`] tags and their first-packet slots), for
    /// [`MappedStore::install_tagged`] and [`MappedStore::tag`].
    pub fn map_tags(&mut self, fd: BorrowedFd<'_>, id: u32, lines: u32) -> io::Result<()> {
        let bytes = lines as usize * size_of::<ratelimit_common::TagLine>();
        if lines < ratelimit_common::bucket_tag_lines(self.records) {
            return Err(io::Error::other(format!(
                "{lines} lines of tags for {} records",
                self.records
            )));
        }
        self.tags = Some(SharedMapping::shared(fd, id, bytes)?);
        Ok(())
    }

    /// Record `i`'s tag, if the tags are mapped.
    #[must_use]
    pub fn tag(&self, i: u32) -> Option<u8> {
        assert!(i < self.records, "record {i} out of {}", self.records);
        let tags = self.tags.as_ref()?;
        // SAFETY: record `i`'s tag byte, in a mapping of a line for each 32 records (checked in
        // `map_tags`).
        Some(unsafe { std::ptr::read_volatile(tags.ptr().add(record_tag_offset(i))) })
    }

    /// The first record.
    fn base(&self) -> *mut Bucket {
        self.mapping.ptr().cast()
    }

    /// Number of records.
    #[must_use]
    pub fn records(&self) -> u32 {
        self.records
    }

    /// A copy of record `i`.
    #[must_use]
    pub fn get(&self, i: u32) -> Bucket {
        assert!(i < self.records, "record {i} out of {}", self.records);
        // SAFETY: in bounds of the mapping; a volatile copy of memory other CPUs write.
        unsafe { std::ptr::read_volatile(self.base().add(i as usize)) }
    }

    fn word(&self, i: u32, offset: usize) -> &AtomicU64 {
        assert!(i < self.records, "record {i} out of {}", self.records);
        // SAFETY: an 8-aligned u64 inside record `i` of the mapping (page-aligned, 64-byte
        // records), which lives as long as `self`.
        unsafe {
            &*self
                .base()
                .add(i as usize)
                .cast::<u8>()
                .add(offset)
                .cast::<AtomicU64>()
        }
    }

    /// Hands `f` a copy of every record that holds a key, with its index. An empty record costs
    /// one load of its header word, so a walk of a mostly empty store is cheap.
    pub fn for_each(&self, mut f: impl FnMut(u32, &Bucket)) {
        self.for_each_in(0..self.records, |i, b| {
            f(i, b);
            ControlFlow::Continue(())
        });
    }

    /// [`MappedStore::for_each`] over the records of `range` (clamped to the store), until `f`
    /// breaks: returns the index of the record `f` broke on (not done), else the range's end.
    pub fn for_each_in(
        &self,
        range: std::ops::Range<u32>,
        mut f: impl FnMut(u32, &Bucket) -> ControlFlow<()>,
    ) -> u32 {
        let base = self.mapping.ptr();
        let end = range.end.min(self.records);
        for i in range.start..end {
            // SAFETY: the header word of record `i`, in bounds and 8-aligned.
            let header = unsafe {
                std::ptr::read_volatile(
                    base.add(i as usize * size_of::<Bucket>() + BUCKET_HEADER_OFFSET)
                        .cast::<u64>(),
                )
            };
            if (header >> 16) & 0xff == 0 {
                continue;
            }
            if f(i, &self.get(i)).is_break() {
                return i;
            }
        }
        end
    }

    /// Where `key`'s bucket of generation `gen` is in a store of `sets` sets under `seed`, or
    /// where it would go at `now` (the coarse clock); `rule_of` gives the current record of a
    /// rule id, to judge what taking a record loses. The program's choice exactly
    /// (`ratelimit-ebpf/src/store.rs`).
    pub fn locate(
        &self,
        seed: [u64; 2],
        sets: u32,
        key: &BucketKey,
        gen: u32,
        now: u64,
        mut rule_of: impl FnMut(u32) -> Option<Rule>,
    ) -> Slot {
        let Some(sets) = self.sets_of(seed, sets, key) else {
            return Slot::Busy;
        };
        // First the key alone, as the program looks: a lookup (explain, the cluster's reads of
        // its published keys) judges no victim and reads no rule record.
        if let Some(i) = self.holder(sets, key, gen, u32::MAX) {
            return Slot::Found(i);
        }
        let mut chooser = VictimChooser::new();
        let mut headers = [0u64; BUCKET_CANDIDATES as usize];
        for c in 0..BUCKET_CANDIDATES {
            let b = self.get(bucket_candidate(sets, c));
            let rule = rule_of(u32::from(b.rule));
            headers[c as usize] = b.header();
            chooser.offer(
                c,
                victim_score(b.header(), b.tat_ns, b.byte_tat_ns, rule.as_ref(), now),
            );
        }
        match chooser.choose() {
            Some((c, score)) => Slot::Vacant {
                index: bucket_candidate(sets, c),
                header: headers[c as usize],
                score,
            },
            None => Slot::Busy,
        }
    }

    /// The record of `key`'s sets, other than `mine`, that holds `key` (generation `gen`): a
    /// second bucket of one key, made by the program at the same instant as this writer's.
    #[must_use]
    pub fn other_holder(
        &self,
        seed: [u64; 2],
        sets: u32,
        key: &BucketKey,
        gen: u32,
        mine: u32,
    ) -> Option<u32> {
        self.holder(self.sets_of(seed, sets, key)?, key, gen, mine)
    }

    /// `key`'s two sets in a store of `sets` sets under `seed`, as the program places them;
    /// `None` if the store is unusable.
    #[must_use]
    pub fn sets_of(&self, seed: [u64; 2], sets: u32, key: &BucketKey) -> Option<[u32; 2]> {
        if sets == 0 || sets.saturating_mul(BUCKET_WAYS) > self.records {
            return None;
        }
        let addr = addr_words(&key.addr);
        Some(bucket_sets(
            bucket_hash(seed, key.rule, key.family, addr),
            sets,
        ))
    }

    /// The first record of `sets` other than `mine` holding `key` of generation `gen`.
    fn holder(&self, sets: [u32; 2], key: &BucketKey, gen: u32, mine: u32) -> Option<u32> {
        let addr = addr_words(&key.addr);
        let header = bucket_header(key.rule, key.family, gen);
        (0..BUCKET_CANDIDATES)
            .map(|c| bucket_candidate(sets, c))
            .find(|&i| {
                let b = self.get(i);
                i != mine && b.header() == header && addr_words(&b.addr) == addr
            })
    }

    /// Moves record `i`'s packet TAT (`tat = max(tat, now) + cost`) and byte TAT likewise, with
    /// the program's compare-and-swap, if it still holds `header`. `false` if it no longer does.
    pub fn advance(&self, i: u32, header: u64, now: u64, cost: u64, byte_cost: u64) -> bool {
        self.advance_capped(i, header, now, (cost, u64::MAX), (byte_cost, u64::MAX))
            .is_some()
    }

    /// As [`Self::advance`], but neither TAT is moved past its ceiling (`(cost, ceiling)` each;
    /// a TAT already past it stays where it is). `None` if the record no longer holds `header`,
    /// else whether a ceiling cut a cost short.
    pub fn advance_capped(
        &self,
        i: u32,
        header: u64,
        now: u64,
        pkt: (u64, u64),
        byte: (u64, u64),
    ) -> Option<bool> {
        self.require_writable();
        let mut capped = false;
        let mut advance = |offset: usize, (cost, ceiling): (u64, u64)| {
            if cost == 0 {
                return;
            }
            let w = self.word(i, offset);
            let mut cut_short = false;
            let _ = w.fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                let (new, cut) = advance_tat(tat, now, cost, ceiling);
                cut_short = cut;
                Some(new)
            });
            capped |= cut_short;
        };
        if self.word(i, BUCKET_HEADER_OFFSET).load(Ordering::Acquire) != header {
            return None;
        }
        advance(std::mem::offset_of!(Bucket, tat_ns), pkt);
        advance(std::mem::offset_of!(Bucket, byte_tat_ns), byte);
        Some(capped)
    }

    /// Writes `fresh` into record `i` (which held `old` when scanned) as the program does: claim
    /// by compare-and-swap of the header (busy), write, publish. `false` if the record changed
    /// meanwhile (another writer took it). The record's tag is left as it is: for a record given
    /// the bucket of the key it holds, or of no key; one taken for another key needs
    /// [`MappedStore::install_tagged`].
    pub fn install(&self, i: u32, old: u64, fresh: &Bucket) -> bool {
        self.install_with(i, old, fresh, None)
    }

    /// [`MappedStore::install`] of a key's bucket with the key's tag `tag` (`bucket_tag`), given
    /// after the claim and before the publication, as the program gives it: a record that holds
    /// a key has its tag (`ratelimit_common::tags`). Panics if the tags are not mapped.
    pub fn install_tagged(&self, i: u32, old: u64, fresh: &Bucket, tag: u8) -> bool {
        self.install_with(i, old, fresh, Some(tag))
    }

    fn install_with(&self, i: u32, old: u64, fresh: &Bucket, tag: Option<u8>) -> bool {
        self.require_writable();
        let header = self.word(i, BUCKET_HEADER_OFFSET);
        let want = fresh.header() & !(u64::from(u8::MAX) << 24);
        let busy = want | u64::from(BUCKET_BUSY) << 24;
        if header
            .compare_exchange(old, busy, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        if let Some(tag) = tag {
            let tags = self.tags.as_ref().expect("the bucket tags are mapped");
            tags.require_writable("the bucket tags");
            // SAFETY: record `i`'s tag byte, in a mapping of a line for each 32 records (checked
            // in `map_tags`); an atomic byte store, as the program's (other writers write other
            // bytes).
            unsafe {
                (*tags.ptr().add(record_tag_offset(i)).cast::<AtomicU8>())
                    .store(tag, Ordering::Release)
            };
        }
        let mut rec = *fresh;
        rec.state = BUCKET_BUSY;
        // SAFETY: record `i` is ours until the header is published (readers skip busy records).
        unsafe { std::ptr::write_volatile(self.base().add(i as usize), rec) };
        // A swap, not a release store: the caller looks for another holder of the key next, and
        // a store could be passed by those loads (store buffering), so that it and a program
        // creating the same key at once each missed the other's record.
        header.swap(want, Ordering::SeqCst);
        true
    }

    /// Gives record `i`'s bucket of `limit` the cluster share `share` among `holders` hosts (see
    /// `Bucket::created_share`; share 0 for none, with no holders), if it still holds `header`.
    /// The program only writes the share field when it creates a bucket (while the record is
    /// busy), so the share lands on this bucket or, if the record was taken for a new key
    /// meanwhile (its header changed: checked again after the write), is taken off again: the new
    /// bucket refills at its whole rate until the next round gives it a share of its own. `None`
    /// if the record does not hold `header`, else the share word it had.
    ///
    /// The bucket keeps its tokens, at most what it holds under the new field (`now`:
    /// `CLOCK_MONOTONIC`). Field and TATs are separate words the program may read between
    /// writes, so three writes: each TAT to one that reads as no more than that under either
    /// field ([`ratelimit_common::share::interim`]), the field, then each TAT given back what the
    /// first withheld ([`ratelimit_common::share::settle`]), from whatever the program charged
    /// meanwhile. Without keeping them, a flooded host whose share grew would find the room the
    /// larger share holds as tokens, and one whose share shrank would lose what it banked.
    pub fn set_share(
        &self,
        i: u32,
        header: u64,
        (share, holders): (u16, u8),
        limit: &ratelimit_common::Limit,
        now: u64,
    ) -> Option<u16> {
        use ratelimit_common::{share, SHARE_FIELD_MASK, SHARE_MASK};
        self.require_writable();
        let headers = self.word(i, BUCKET_HEADER_OFFSET);
        if headers.load(Ordering::Acquire) != header {
            return None;
        }
        let w = self.word(i, std::mem::offset_of!(Bucket, created_share));
        let to = share::field(u64::from(share), u64::from(holders));
        let from = w.load(Ordering::Acquire) & SHARE_FIELD_MASK;
        if to != from {
            let tats = [
                (
                    std::mem::offset_of!(Bucket, tat_ns),
                    limit.pkt_tolerance_ns,
                    limit.pkt_interval_ns,
                ),
                // A byte limit's floor (a packet's bytes) depends on the packet: none here.
                (
                    std::mem::offset_of!(Bucket, byte_tat_ns),
                    limit.byte_tolerance_ns,
                    0,
                ),
            ];
            let mut withheld = [0u64; 2];
            for (k, &(offset, tolerance, cost)) in tats.iter().enumerate() {
                let (k_from, k_to) = (
                    share::capacity(tolerance, cost, from),
                    share::capacity(tolerance, cost, to),
                );
                let _ =
                    self.word(i, offset)
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                            let (t, held) = share::interim(tat, now, from, to, k_from, k_to);
                            withheld[k] = held;
                            Some(t)
                        });
            }
            let _ = w.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v & !SHARE_FIELD_MASK | to)
            });
            for (k, &(offset, ..)) in tats.iter().enumerate() {
                let _ =
                    self.word(i, offset)
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                            Some(share::settle(tat, now, to, withheld[k]))
                        });
            }
        }
        if headers.load(Ordering::Acquire) != header {
            self.clear_share(i, now);
            return None;
        }
        Some(u16::try_from(from & SHARE_MASK).unwrap_or(0))
    }

    /// Brings record `i`'s TATs from the time of share word `from` into `to`'s, their tokens
    /// kept, by compare-and-swap (see [`ratelimit_common::share::convert`]).
    fn convert_tats(&self, i: u32, now: u64, from: u64, to: u64) {
        for offset in [
            std::mem::offset_of!(Bucket, tat_ns),
            std::mem::offset_of!(Bucket, byte_tat_ns),
        ] {
            let _ = self
                .word(i, offset)
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                    ratelimit_common::share::convert(tat, now, from, to)
                });
        }
    }

    /// Clears every bucket's share word (see `Bucket::created_share`), its tokens kept: what an
    /// agent's cluster sync does before its first round, so that no share an earlier agent left
    /// holds once this one renews `Config::shares_until_ns`. Returns how many it cleared.
    pub fn clear_shares(&self, now: u64) -> u64 {
        self.require_writable();
        let mut cleared = 0;
        self.for_each(|i, b| {
            if b.share() != 0 {
                self.clear_share(i, now);
                cleared += 1;
            }
        });
        cleared
    }

    /// Clears record `i`'s share field (its creation time kept), by compare-and-swap, then brings
    /// its TATs into the whole rate's time keeping their debt, as the program does when the
    /// shares lapse (the limit, and so what each field holds, is not known here).
    fn clear_share(&self, i: u32, now: u64) {
        let w = self.word(i, std::mem::offset_of!(Bucket, created_share));
        let was = w
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v & !ratelimit_common::SHARE_FIELD_MASK)
            })
            .unwrap_or_else(|v| v);
        self.convert_tats(i, now, was & ratelimit_common::SHARE_MASK, 0);
    }

    fn require_writable(&self) {
        self.mapping.require_writable("the bucket store");
    }
}

/// `tat` moved by `cost` from `now` (`max(tat, now) + cost`) but not past `ceiling` (a TAT already
/// past it stays): the new TAT and whether the ceiling cut the cost short.
#[must_use]
pub fn advance_tat(tat: u64, now: u64, cost: u64, ceiling: u64) -> (u64, bool) {
    let want = tat.max(now).saturating_add(cost);
    if want <= ceiling {
        (want, false)
    } else {
        (tat.max(ceiling), true)
    }
}
