//! Per-CPU scratch state that makes a known source's packet cheaper: a cached coarse clock, a
//! small classification cache, and drop windows of rules' `per = "rule"` limits (which make a
//! flood of new sources cheap). All are caches of what the packet would compute anyway, so they
//! change no verdict; the map is not pinned (a fresh program starts with empty caches).

use aya_ebpf::{
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    macros::map,
    maps::PerCpuArray,
};
use ratelimit_common::{FragEntry, FragKey, VictimChooser};

use crate::parse::Packet;

/// Per-CPU caches. Not pinned: they only hold what packets would compute anyway.
#[map(name = "RL_SCRATCH")]
pub static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// A [`ClassSlot::bucket`] that names no record.
pub const NO_RECORD: u32 = u32::MAX;

/// Slots of the classification cache (a power of two). Direct-mapped by a hash of the source: a
/// busy source keeps its slot, a spoofed flood overwrites slots and pays only the miss.
pub const CLASS_SLOTS: usize = 256;

/// A slot holds a classification.
pub const SLOT_VALID: u8 = 1 << 0;
/// The classification does not depend on the protocol and port (its first candidate matches any),
/// so any packet from this source under this epoch has it.
pub const SLOT_ANY_L4: u8 = 1 << 1;
/// Rule id of a cached "no rule matches".
pub const NO_RULE: u32 = u32::MAX;

/// Dropped packets a CPU decides from [`ClassSlot::drop_until`] before it looks at the bucket
/// again (which adds those drops to its counter, and sees whether the record still holds it).
pub const DROP_BATCH: u32 = 64;
// A charge after a batch still finds a bucket within its grown window (`find::mark_grown`).
const _: () = assert!(DROP_BATCH < ratelimit_common::GROWN_WINDOW);

/// One cached classification: under rule-set `epoch`, a packet from `src` (with `protocol`,
/// `dst_port` and TCP flags `tcp_flags` under `tcp_mask`, unless [`SLOT_ANY_L4`]) falls under
/// `rule` ([`NO_RULE`]: none).
///
/// `tcp_mask` is the union of the flag bits the candidate walk looked at (every rule it tried,
/// up to the one that matched): the walk's outcome depends on those bits only, so a packet that
/// agrees on them gets the same rule. For a source no flag rule applies to it is 0, and every
/// packet agrees: a SYN flood and its source's ACKs then share the slot.
///
/// Plus a drop window for that source's bucket. A bucket's TAT only moves forward (packets and
/// cluster charges add to it; a rule change starts a new epoch, which empties every slot), so once
/// a packet was dropped for its rate, every packet before `drop_until` (when the next token comes)
/// would be dropped too: this CPU drops them without the bucket lookup, up to [`DROP_BATCH`] in a
/// row. For a source over its limit that is nearly every packet. Only `drop_count`'s drops are
/// missing from the bucket's own counter until the next lookup (or lost if the slot is taken by
/// another source first); rule counters count every packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ClassSlot {
    pub epoch: u32,
    pub rule: u32,
    pub family: u8,
    pub flags: u8,
    pub dst_port: u16,
    pub protocol: u8,
    pub tcp_mask: u8,
    pub tcp_flags: u8,
    /// The limit of the rule (0: its own) whose drop window `drop_until` is.
    pub drop_limit: u8,
    pub src: [u32; 4],
    /// Packets under the rule's packet limit are dropped before this time (rule's clock, ns).
    pub drop_until: u64,
    /// Packets dropped from the window since the bucket was last looked at.
    pub drop_count: u32,
    /// Index of the record that held this source's bucket when last found (verified against the
    /// key at every use), or [`NO_RECORD`]: the bucket of the rule's first limit.
    pub bucket: u32,
    /// Likewise for the buckets of the rule's other limits (`Rule::extra`).
    pub extra: [u32; 3],
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<ClassSlot>() == 64);

/// Slots of the per-rule drop windows (a power of two), direct-mapped by rule id.
pub const GATE_SLOTS: usize = 64;

/// The drop window of a rule's `per = "rule"` packet limit ([`rule_flags::GATE`]), kept by rule
/// rather than by source: a flood of random sources misses every [`ClassSlot`] (each frame a new
/// source), but all its frames, of either family, share this slot, as they share the bucket.
/// Under rule-set `epoch`, packets of rule `rule` are dropped before `drop_until` (the limit's one bucket has no token until
/// then; its TAT only moves forward, as for [`ClassSlot::drop_until`]), up to [`DROP_BATCH`] in a
/// row; then the bucket, in record `record` (verified against its key), is looked at again: its
/// counter gets the window's drops, and the window is renewed while it still has no token.
///
/// [`rule_flags::GATE`]: ratelimit_common::rule_flags::GATE
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GateSlot {
    pub epoch: u32,
    pub rule: u32,
    /// [`SLOT_VALID`] when it holds a window.
    pub flags: u8,
    pub _pad: [u8; 3],
    /// Index of the record that held the limit's bucket.
    pub record: u32,
    /// Packets of the rule are dropped before this time (rule's clock, ns).
    pub drop_until: u64,
    /// Packets dropped from the window since the bucket was last looked at.
    pub drop_count: u32,
    pub _pad2: u32,
}
const _: () = assert!(core::mem::size_of::<GateSlot>() == 32);

/// The single record of [`SCRATCH`] (one per CPU).
#[repr(C)]
pub struct Scratch {
    /// `bpf_jiffies64()` when `clock_ns` was read.
    pub clock_jiffies: u64,
    /// `bpf_ktime_get_coarse_ns()` read at `clock_jiffies`.
    pub clock_ns: u64,
    pub class: [ClassSlot; CLASS_SLOTS],
    /// Drop windows of rules' `per = "rule"` limits: see [`GateSlot`].
    pub gate: [GateSlot; GATE_SLOTS],
    /// A slot for packets classified outside the cache (fragments that follow their first
    /// fragment, packets without an L4 header): emptied before each use, so no drop window or
    /// record index carries over.
    pub uncached: ClassSlot,
    /// See [`launder_packet`].
    pub packet: Packet,
    /// See [`launder`].
    pub word: u64,
    /// The bucket store's choice of a record for a new key, kept here rather than on the stack
    /// for the same reason as [`launder`] (see `store::choose`).
    pub chooser: VictimChooser,
    /// What the extra limits' charges (`one_limit`, a BPF call) need of the packet and give
    /// back: here, not on the stack the calls share (CONSTRAINTS.md, "Stack").
    pub extra: Extra,
    /// The key of the extra limit being charged (`one_limit`): here, not on its BPF call's
    /// stack (CONSTRAINTS.md, "Stack").
    pub extra_key: Key,
    /// The first limit's bucket key (in `limit`): here rather than on the program's full frame
    /// (CONSTRAINTS.md, "Stack").
    pub first_key: Key,
    /// The drop window's end from `one_limit`'s charge (here rather than on its frame).
    pub extra_until: u64,
    /// The prefix trie key of the packet's lookup (`classify::prefix_key`): here rather than on
    /// the frames of the entry and `decide_cut`, which inline the lookup (CONSTRAINTS.md, "Stack").
    pub trie_key: TrieKey,
    /// The fragment table's key and new entry (`frag.rs`): here rather than on `decide_cut`'s
    /// frame (CONSTRAINTS.md, "Stack").
    pub frag_key: FragKey,
    pub frag_entry: FragEntry,
}

/// A prefix trie key as the trie reads it, `Key<PrefixKey>` (22 bytes: the prefix length, then
/// the key's generation, family and address), with the alignment its words have there (the
/// address at offset 6 as eight 16-bit words), where the packed `Key` has alignment 1.
#[repr(C, align(8))]
pub struct TrieKey {
    pub prefix_len: u32,
    pub generation: u8,
    pub family: u8,
    pub addr: [u16; 8],
}
const _: () = assert!(
    core::mem::size_of::<TrieKey>()
        >= core::mem::size_of::<aya_ebpf::maps::lpm_trie::Key<ratelimit_common::PrefixKey>>()
);

/// A bucket key as the records hold it: the masked address as two words and the header word
/// (rule id, family, rule generation; state 0). Built by `store::key`; defined here so that an
/// extra limit's key can live in the scratch record (see [`Scratch::extra_key`]).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Key {
    pub addr: [u64; 2],
    pub header: u64,
}

/// See [`Scratch::extra`].
#[repr(C)]
pub struct Extra {
    pub id: u32,
    /// Drops the slot's window made (to add to limit `drop_limit`'s bucket when it is found).
    pub drop_count: u32,
    pub len: u64,
    pub now: u64,
    /// On a rate drop: the end of the dropping limit's window.
    pub until: u64,
    pub drop_limit: u32,
    /// The record each extra limit's bucket was found in (`NO_RECORD`: none, fail open).
    pub records: [u32; 3],
    /// The rule-set epoch (for `gate`).
    pub epoch: u32,
    /// What the packet's charges read of the clocks.
    pub clock: ChargeClock,
}

/// What a packet's charges read of the clocks, in the scratch record (one pointer to it is one
/// argument where its parts would be two).
#[repr(C)]
pub struct ChargeClock {
    /// `Config::shares_until_ns` as this packet read it (cluster shares hold before it).
    pub shares_until: u64,
    /// The precise clock as a charge of this packet read it, for its other charges, or 0 (not
    /// read yet): a rule on the coarse clock reads it where the coarse one could be wrong (see
    /// the program's `bucket::clock`), at most once a packet whatever its number of limits.
    pub precise: u64,
    /// A cluster-scoped charge's drop window end (`bucket::rl_charge_cluster`'s result beside
    /// its verdict: a BPF call returns one word).
    pub until: u64,
    /// The time and length of a cluster-scoped charge (`bucket::rl_charge_cluster`'s arguments:
    /// through the scratch record, the caller keeps fewer values across the call).
    pub now: u64,
    pub len: u64,
    /// The limit a cluster-scoped charge is of (`bucket::rl_charge_cluster`'s parameters).
    pub limit: LimitParams,
}

/// The precise clock for this packet: as an earlier charge of it read it (see
/// [`ChargeClock::precise`]), else read now and kept for the next.
#[inline(always)]
pub fn precise_now(ck: *mut ChargeClock) -> u64 {
    // SAFETY: `ck` is in this CPU's live scratch record; a helper without preconditions.
    unsafe {
        let kept = (*ck).precise;
        if kept != 0 {
            return kept;
        }
        let now = bpf_ktime_get_ns();
        (*ck).precise = now;
        now
    }
}

/// `word`, written to this CPU's scratch record and read back. The verifier does not track
/// values through map memory, so what comes back is "some word" rather than one of the many
/// constants it could be: the code after it is verified once for all of them, not once each
/// (CONSTRAINTS.md, "Values kept out of registers"). One aligned word costs about a nanosecond.
#[inline(always)]
pub fn launder(s: *mut Scratch, word: u64) -> u64 {
    // SAFETY: this CPU's live map value (see `coarse_now`); volatile so the round trip stays.
    unsafe {
        core::ptr::write_volatile(&raw mut (*s).word, word);
        core::ptr::read_volatile(&raw const (*s).word)
    }
}

/// [`launder`] for a whole packet: for the rare shapes (fragments, packets without an L4
/// header), whose many constant outcomes of the parse would each be verified through the rest of
/// the program. Whole packets skip it: the round trip costs tens of nanoseconds.
#[inline(always)]
pub fn launder_packet(s: *mut Scratch, pkt: &mut Packet) {
    // Copied in place both ways: `write_volatile(.., *pkt)` copied the packet to a temporary on
    // the program's frame first, a 44-byte slot that every map key of the program then shared
    // (CONSTRAINTS.md, "Stack").
    // SAFETY: as above; the packet and the scratch record do not overlap.
    unsafe {
        core::intrinsics::volatile_copy_nonoverlapping_memory(&raw mut (*s).packet, pkt, 1);
        core::intrinsics::volatile_copy_nonoverlapping_memory(pkt, &raw const (*s).packet, 1);
    }
}

/// This CPU's slot for a packet classified outside the cache, emptied.
#[inline(always)]
pub fn uncached_slot(s: *mut Scratch) -> *mut ClassSlot {
    // SAFETY: this CPU's live map value (see `coarse_now`).
    let slot = unsafe { &raw mut (*s).uncached };
    empty_slot(slot);
    slot
}

/// Empties `slot`'s drop window and remembered records. The extra limits' records with volatile
/// stores, which the compiler cannot merge into a `memset` call (CONSTRAINTS.md, "Memory
/// builtins"); the others plain, so that the compiler knows them where the packet's limit is
/// charged ("Instruction budget").
#[inline(always)]
pub fn empty_slot(slot: *mut ClassSlot) {
    // SAFETY: this CPU's live slot (the caller's).
    unsafe {
        (*slot).drop_until = 0;
        (*slot).drop_count = 0;
        (*slot).drop_limit = 0;
        (*slot).bucket = NO_RECORD;
        no_records(&raw mut (*slot).extra);
    }
}

/// Sets the three record indexes at `r` to `NO_RECORD`, with volatile stores (see `empty_slot`).
#[inline(always)]
pub fn no_records(r: *mut [u32; 3]) {
    let r = r.cast::<u32>();
    // SAFETY: three u32 at `r` (the caller's live scratch record).
    unsafe {
        core::ptr::write_volatile(r, NO_RECORD);
        core::ptr::write_volatile(r.add(1), NO_RECORD);
        core::ptr::write_volatile(r.add(2), NO_RECORD);
    }
}

/// This CPU's scratch record.
#[inline(always)]
pub fn get() -> Option<*mut Scratch> {
    SCRATCH.get_ptr_mut(0)
}

/// `bpf_ktime_get_coarse_ns()` for a fraction of its cost.
///
/// The coarse clock only moves when the timekeeping tick runs, which also advances jiffies, and
/// `bpf_jiffies64()` is a plain load. So the clock is read once per jiffy per CPU and cached. The
/// tick advances jiffies just before the clock: a read in between returns the clock unmoved, and
/// is then not cached, so the next packet reads it again.
#[inline(always)]
pub fn coarse_now(s: *mut Scratch) -> u64 {
    // SAFETY: helpers without preconditions; `s` is this CPU's live map value and XDP runs with
    // preemption disabled, so nothing else touches it meanwhile.
    unsafe {
        let j = bpf_jiffies64();
        if j == (*s).clock_jiffies {
            return (*s).clock_ns;
        }
        let ns = bpf_ktime_get_coarse_ns();
        if ns != (*s).clock_ns {
            (*s).clock_jiffies = j;
            (*s).clock_ns = ns;
        }
        ns
    }
}

/// The classification cache slot of a source.
#[inline(always)]
pub fn slot_index(src: &[u32; 4]) -> usize {
    let h = (src[0] ^ src[1] ^ src[2] ^ src[3]).wrapping_mul(0x9e37_79b1);
    (h >> 24) as usize & (CLASS_SLOTS - 1)
}

/// A limit's parameters, copied into the scratch record for `bucket::rl_charge_cluster` (a BPF global
/// function takes five scalar or pointer arguments at most).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LimitParams {
    pub flags: u64,
    pub pkt_interval_ns: u64,
    pub pkt_tolerance_ns: u64,
    pub byte_interval_fp: u64,
    pub byte_tolerance_ns: u64,
}
