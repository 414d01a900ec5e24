//! Fragments follow their datagram's first fragment: the first fragment (which alone carries the
//! L4 header) is classified as any packet, and its classification is remembered for as long as
//! the kernel keeps fragments for reassembly, in an LRU map keyed by the datagram as the kernel
//! keys it (source, destination, identification, and for IPv4 the protocol: an IPv6 datagram's
//! protocol is its first fragment's, whatever the next header of the others says), so the
//! other fragments of a denied datagram are dropped and those of a limited one charge the same
//! bucket. A first fragment sent again for the same datagram with another classification (an
//! overlap trying to rewrite the ports) drops the datagram: a verdict never flips to pass. A
//! fragment that comes before its first (or after it was forgotten) is dropped where a rule that
//! looks at the port could apply (`decide_cut`), so that datagram never completes.

use aya_ebpf::bindings::BPF_ANY;
use ratelimit_common::{family, frag_flags, FragEntry, FragKey, FRAGMENT_TIMEOUT_NS};

use crate::{maps::FRAGMENTS, parse::Packet, scratch::Scratch};

/// The datagram `pkt` is a fragment of, as the fragment table's key, built in this CPU's scratch
/// record rather than on `decide_cut`'s frame (CONSTRAINTS.md, "Stack").
#[inline(always)]
fn key(pkt: &Packet, s: *mut Scratch) -> &'static FragKey {
    // SAFETY: this CPU's live scratch record (XDP runs with preemption disabled); nothing else of
    // this program run uses the key meanwhile.
    unsafe {
        let k = &raw mut (*s).frag_key;
        *k = FragKey {
            family: pkt.family,
            // The kernel reassembles an IPv6 datagram by source, destination and
            // identification alone: a later fragment naming another next header is still part
            // of it.
            protocol: if pkt.family == family::V6 {
                0
            } else {
                pkt.frag_protocol
            },
            _pad: 0,
            id: pkt.frag_id,
            src: pkt.src,
            dst: pkt.dst,
        };
        &*k
    }
}

/// Why a datagram's fragments are dropped: a [`frag_flags`] reason bit, kept with the entry so
/// its other fragments are counted under the same reason.
pub const REASON_SHIFT: u32 = 8;

/// What the datagram's first fragment decided, for a fragment other than the first: `None` if it
/// was not seen under this rule-set `epoch` within [`FRAGMENT_TIMEOUT_NS`].
#[inline(always)]
pub fn recall(pkt: &Packet, epoch: u32, now: u64, s: *mut Scratch) -> Option<FragEntry> {
    let e = FRAGMENTS.get_ptr(key(pkt, s))?;
    // SAFETY: a live map value.
    let e = unsafe { *e };
    (e.epoch == epoch && now.wrapping_sub(e.time_ns) < FRAGMENT_TIMEOUT_NS).then_some(e)
}

/// Remembers how the datagram's first fragment was classified (`rule`, or `drop` with its
/// `reason` counter). If a first fragment of the same datagram was already seen (within
/// [`FRAGMENT_TIMEOUT_NS`], same epoch) and classified otherwise, or its datagram is dropped,
/// the datagram is dropped from now on and `Some(reason counter)` says why this fragment is
/// dropped too.
#[inline(always)]
pub fn remember(
    pkt: &Packet,
    epoch: u32,
    now: u64,
    rule: u32,
    drop: Option<usize>,
    s: *mut Scratch,
) -> Option<usize> {
    let key = key(pkt, s);
    if let Some(e) = FRAGMENTS.get_ptr_mut(key) {
        // SAFETY: a live map value; a race with another CPU's first fragment of the same
        // datagram at worst keeps one classification or the other, both already judged.
        let old = unsafe { *e };
        if old.epoch == epoch && now.wrapping_sub(old.time_ns) < FRAGMENT_TIMEOUT_NS {
            if old.flags & frag_flags::DROP != 0 {
                return Some((old.flags >> REASON_SHIFT) as usize);
            }
            if old.rule != rule || drop.is_some() {
                let reason = drop.unwrap_or(ratelimit_common::global::DROPPED_FRAGMENT_CONFLICTS);
                // SAFETY: as above.
                unsafe {
                    (*e).flags = frag_flags::DROP | (reason as u32) << REASON_SHIFT;
                }
                return Some(reason);
            }
            return None;
        }
    }
    // In the scratch record too, as the key.
    // SAFETY: this CPU's live scratch record.
    let entry = unsafe { &mut (*s).frag_entry };
    *entry = FragEntry {
        epoch,
        rule,
        flags: match drop {
            Some(reason) => frag_flags::DROP | (reason as u32) << REASON_SHIFT,
            None => 0,
        },
        _pad: 0,
        time_ns: now,
    };
    // A full map evicts the least recently used datagram: its later fragments are then unmatched
    // (counted `fragments_unmatched`), dropped where a rule that looks at the port could apply
    // (see `decide_cut`), else classified without ports.
    let _ = FRAGMENTS.insert(key, entry, u64::from(BPF_ANY));
    drop
}
