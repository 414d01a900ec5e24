//! The rule's limits: charged in order, the first inline on the packet's path, the others through
//! `one_limit` (a global BPF function) unless the classification slot remembers their records; a
//! drop gives the limits before it their charge back. Frames and calls: CONSTRAINTS.md, "Shape".

use aya_ebpf::helpers::bpf_ktime_get_ns;
use ratelimit_common::{rule_flags, verdict, Bucket, Config, Rule, MAX_LIMITS};

use crate::{
    bucket, classify,
    find::{charge_clock, find_and_charge, mark_grown},
    gate::{gate, gate_slot, open_gate},
    maps::BUCKETS,
    parse::Packet,
    scratch::{self, ClassSlot, Extra, Scratch, DROP_BATCH, NO_RECORD, SLOT_VALID},
    store,
};

/// Charges the packet to the buckets of its rule's limits, creating a bucket for a source (or
/// group) not seen before. Returns the verdict, and in bits 8.. the limit that dropped it.
///
/// Limits are charged in order; a packet one limit drops is refunded to the limits before it
/// (`bucket::refund`, exact), so it spends no token of any limit. The first limit's path is the
/// one-limit rule's whole path, unchanged; the others go through `extra_limits` (a record to find
/// or create through `one_limit`, a BPF call), so a one-limit rule's packet pays nothing for them.
///
/// Before any of that, and before the source's own drop window (in its classification slot,
/// which the per-rule window does not need: see `classify::claim`), a rule with a `per = "rule"`
/// packet limit ([`rule_flags::GATE`]) drops
/// the packet if that limit's one bucket is known to have no token ([`gate`]): the same verdict
/// and the same tokens as charging in order (a packet passes only with a token in every limit,
/// and a dropped one spends none), but a flood of new sources makes no bucket per source, and
/// the drop is blamed on the per-rule limit even where an earlier limit would have dropped it too.
// Stays whole: inlined into the entry; its shape is what the verifier passes (CONSTRAINTS.md).
// Split into inlined steps, the same statements compile to an entry the verifier rejects (the
// bound of the dropping limit's index is lost before `open_gate`: docs/journal.md, "Two tries
// on the known path and the entry that were not kept").
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
pub fn limit(
    pkt: &Packet,
    id: u32,
    rule: &Rule,
    len: u64,
    s: *mut Scratch,
    slot: *mut ClassSlot,
    config: *const Config,
    epoch: u32,
    unclaimed: bool,
) -> usize {
    // The clock the agent chose for the rule (CONSTRAINTS.md, "Clocks"). On the coarse one, a
    // charge reads the precise clock where the lag could change a verdict (`bucket::clock`).
    let now = if rule.flags & rule_flags::COARSE_CLOCK != 0 {
        // Not read yet for this packet (see `ChargeClock::precise`).
        // SAFETY: this CPU's live scratch record.
        unsafe { (*s).extra.clock.precise = 0 };
        scratch::coarse_now(s)
    } else {
        // SAFETY: a helper without preconditions.
        unsafe { bpf_ktime_get_ns() }
    };
    if rule.flags & rule_flags::GATE != 0 {
        // The window itself is checked inline (a BPF call costs more than the whole check): the
        // packets of a flood under an empty aggregate, nearly all of them, stop here. Only a
        // window that is over or whose batch is spent calls `gate` to look at the bucket; no
        // window (the aggregate has tokens), no call.
        let g = gate_slot(s, id);
        // SAFETY: this CPU's live scratch record (XDP runs with preemption disabled).
        unsafe {
            let open = (*g).rule == id && (*g).epoch == epoch && (*g).flags & SLOT_VALID != 0;
            let count = (*g).drop_count;
            if open
                && count < DROP_BATCH
                && bucket::window_holds(
                    rule.flags,
                    rule_flags::HOLD_GATE,
                    now,
                    (*g).drop_until,
                    charge_clock(s),
                )
            {
                (*g).drop_count = count + 1;
                let k = rule_flags::gate_limit(rule.flags);
                return verdict::DROPPED_RATE | (k as usize) << 8;
            }
            // The packet's context for the BPF calls (`gate`, and `open_gate` below): stored
            // only past the window, which drops nearly every packet of a flood.
            let c = &raw mut (*s).extra;
            (*c).id = id;
            (*c).len = len;
            (*c).now = now;
            (*c).epoch = epoch;
            if open {
                // Laundered: the call's few outcomes would each be verified through the rest.
                let d = scratch::launder(s, gate(pkt, rule) as u64) as usize;
                if d != 0 {
                    return d;
                }
            }
        }
    }
    // The source's slot, from here on (the per-rule window above needs only the rule): a
    // source classified from the IPv4 table makes it its own first (`classify::claim`).
    if unclaimed {
        classify::claim(pkt, epoch, slot, id);
    }
    // SAFETY: this CPU's classification slot for this packet (see `scratch`).
    let (drop_until, drop_count, drop_limit, cached) = unsafe {
        (
            (*slot).drop_until,
            (*slot).drop_count,
            (*slot).drop_limit,
            (*slot).bucket,
        )
    };
    if drop_count < DROP_BATCH
        && bucket::window_holds(
            rule.flags,
            rule_flags::HOLD_WINDOW,
            now,
            drop_until,
            charge_clock(s),
        )
    {
        // SAFETY: as above.
        unsafe { (*slot).drop_count = drop_count + 1 };
        return verdict::DROPPED_RATE | usize::from(drop_limit) << 8;
    }
    // SAFETY: this CPU's live scratch record; `config` a live map value. Where every charge
    // of this packet reads it (see `shares_until`).
    unsafe {
        (*s).extra.clock.shares_until =
            core::ptr::read_volatile(&raw const (*config).shares_until_ns);
    }
    // SAFETY: this CPU's live scratch record.
    let key = unsafe { &mut (*s).first_key };
    *key = store::key(pkt, id, 0, &rule.src_mask, rule.bucket_gen);
    // The drop window's end in the scratch record, where a cluster-scoped charge leaves it too:
    // not on this frame (CONSTRAINTS.md, "Stack").
    // SAFETY: this CPU's live scratch record.
    let until = unsafe { &mut (*s).extra.clock.until };
    *until = 0;
    let (v, b) = find_and_charge::<_, true>(key, rule, cached, len, now, s, slot, 0, until);
    // SAFETY: as above; and this CPU's classification slot, whose window fields the charge
    // leaves alone: read again, not kept live across its BPF call (CONSTRAINTS.md, "Stack").
    let (until, drop_count, drop_limit) = unsafe {
        (
            (*s).extra.clock.until,
            (*slot).drop_count,
            (*slot).drop_limit,
        )
    };
    if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES {
        bucket::count(b, false, len);
        // SAFETY: as above, and `b` is a live record (a drop always has one).
        unsafe {
            if drop_limit == 0 {
                (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(drop_count);
            }
            (*slot).drop_until = bucket::window_end(rule.flags, until, now);
            (*slot).drop_count = 0;
            (*slot).drop_limit = 0;
        }
        // Called for every rule, returning at once without a per-rule limit (CONSTRAINTS.md,
        // "Instruction budget"); once per drop window (`DROP_BATCH`), or per byte-rate drop.
        open_gate(rule, slot, v, until);
        return v;
    }
    if rule.extra_len != 0 {
        // SAFETY: this CPU's live scratch record.
        let c = unsafe { &raw mut (*s).extra };
        // SAFETY: as above.
        unsafe {
            (*c).id = id;
            (*c).drop_count = drop_count;
            (*c).len = len;
            (*c).now = now;
            (*c).until = 0;
            (*c).drop_limit = u32::from(drop_limit);
        }
        scratch::no_records(unsafe { &raw mut (*c).records });
        let d = extra_limits(pkt, rule, slot, c);
        if d != verdict::PASSED {
            // Dropped by limit `d >> 8` (> 0): the extra limits before it get their charge back
            // (each only where its record still holds its key), and the first limit's, if its
            // record still holds the key (another CPU may have recycled it meanwhile: the refund
            // would give that key a token it was not charged).
            refund_extra(pkt, rule, (d >> 8) - 1);
            // SAFETY: this CPU's live scratch record (the key `limit` built above).
            if !b.is_null() && store::holds(b, unsafe { &(*s).first_key }) {
                // SAFETY: this CPU's live scratch record (read back, not kept live across the
                // calls: CONSTRAINTS.md, "Stack").
                unsafe { bucket::refund(b, rule, len, (*c).now, &raw const (*c).clock) };
            }
            // SAFETY: as above.
            unsafe {
                (*slot).drop_until = (*c).until;
                (*slot).drop_count = 0;
                (*slot).drop_limit = (d >> 8) as u8;
            }
            // SAFETY: this CPU's live scratch record.
            // As above, for every rule.
            open_gate(rule, slot, d, unsafe { (*c).until });
            return d;
        }
    }
    if !b.is_null() {
        bucket::count(b, true, len);
        // SAFETY: as above.
        unsafe {
            if drop_limit == 0 {
                (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(drop_count);
            }
        }
    }
    // SAFETY: as above.
    unsafe {
        (*slot).drop_until = 0;
        (*slot).drop_count = 0;
    }
    v
}

/// Charges the packet to the rule's limits after its first, in order: `PASSED` (counted in each
/// of their buckets), or a drop (with the limit in bits 8..), after which the caller gives the
/// limits before the dropping one their charge back (`refund_extra`, and the first's).
#[inline(always)]
fn extra_limits(pkt: &Packet, rule: &Rule, slot: *mut ClassSlot, c: *mut Extra) -> usize {
    let n = rule.extra_len as usize;
    for k in 0..MAX_LIMITS - 1 {
        if k >= n {
            break;
        }
        // A known source's record, remembered in its slot, is charged here (inlined): a BPF
        // call costs more than the charge (CONSTRAINTS.md, "Shape"), so only a record to find or
        // create pays it.
        let v = match cached_limit(pkt, rule, slot, c, k) {
            Some(v) => v,
            // SAFETY: the live packet, rule and slot of this packet.
            None => unsafe { one_limit(pkt, rule, slot, k) },
        };
        if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES {
            // The limits before this one get their charge back from the caller
            // (`refund_extra`, and the first's).
            return v | (k + 1) << 8;
        }
    }
    for j in 0..MAX_LIMITS - 1 {
        if j >= n {
            break;
        }
        // SAFETY: as above.
        if let Some(r) = BUCKETS.get_ptr_mut(unsafe { (*c).records[j] }) {
            bucket::count(r, true, unsafe { (*c).len });
        }
    }
    verdict::PASSED
}

/// Gives the extra limits before limit `k + 1` of `rule` (`rule.extra[..k]`, charged for this
/// packet, whose records `extra_limits` left in the scratch record's `Extra::records`) their
/// charge back, each only to a record that still holds its key, as `limit` does for the first:
/// another CPU (or this packet's own later limit, creating its bucket) may have recycled it
/// meanwhile, and the refund would give that key a token it was not charged. A BPF call of its
/// own (once per drop), from `limit` after `extra_limits` returns, where the chain has room
/// (CONSTRAINTS.md, "Stack").
#[inline(never)]
fn refund_extra(pkt: &Packet, rule: &Rule, k: usize) {
    let Some(s) = scratch::get() else {
        return;
    };
    // SAFETY: this CPU's live scratch record (only the address is taken).
    let c = unsafe { &raw mut (*s).extra };
    for j in 0..MAX_LIMITS - 1 {
        if j >= k {
            break;
        }
        // SAFETY: this CPU's live scratch record; `j` is in bounds.
        if let Some(r) = BUCKETS.get_ptr_mut(unsafe { (*c).records[j] }) {
            // The key in the scratch record, not on this frame.
            // SAFETY: this CPU's live scratch record.
            let key = unsafe { &mut (*s).extra_key };
            *key = store::key(
                pkt,
                // SAFETY: as above.
                unsafe { (*c).id },
                j as u32 + 1,
                &rule.extra[j].src_mask,
                rule.bucket_gen,
            );
            if store::holds(r, key) {
                bucket::refund(
                    r,
                    &rule.extra[j],
                    // SAFETY: as above.
                    unsafe { (*c).len },
                    unsafe { (*c).now },
                    unsafe { &raw const (*c).clock },
                );
            }
        }
    }
}

/// Charges the packet to limit `k + 1` of `rule` (`rule.extra[k]`): the verdict; the record is
/// left in the scratch record's `Extra::records[k]`, the drop window's end in `Extra::until`.
/// Not inlined (a BPF call, with the packet's context in the scratch record): a one-limit rule's
/// packet pays nothing for it, and its stack is its own (inlined three times, it would take the
/// program's frame past what the verifier allows beside `decide_cut`'s).
///
/// A *global* BPF function, verified once on its own (CONSTRAINTS.md, "Global functions"); the
/// chain through it to `store::other_holder` is the program's deepest ("Stack").
///
/// # Safety
/// `pkt`, `rule` and `slot` are null or point at a live packet, rule and classification slot.
#[inline(never)]
#[no_mangle]
pub unsafe extern "C" fn one_limit(
    pkt: *const Packet,
    rule: *const Rule,
    slot: *mut ClassSlot,
    k: usize,
) -> usize {
    if pkt.is_null() || rule.is_null() || slot.is_null() {
        return verdict::NO_BUCKET;
    }
    // SAFETY: checked non-null above; the caller's live packet and rule.
    let (pkt, rule) = unsafe { (&*pkt, &*rule) };
    let Some(s) = scratch::get() else {
        return verdict::NO_BUCKET;
    };
    if k >= MAX_LIMITS - 1 {
        return verdict::NO_BUCKET;
    }
    // SAFETY: this CPU's live scratch record, filled by the caller.
    let c = unsafe { &mut (*s).extra };
    let l = &rule.extra[k];
    let limit = k as u32 + 1;
    // SAFETY: this CPU's live scratch record.
    let key = unsafe { &mut (*s).extra_key };
    *key = store::key(pkt, c.id, limit, &l.src_mask, rule.bucket_gen);
    // SAFETY: this CPU's classification slot; `k` is in bounds.
    let cached = unsafe { (*slot).extra[k] };
    let (len, now) = (c.len, c.now);
    // SAFETY: this CPU's live scratch record: the window's end lands there, not on this frame.
    let until = unsafe { &mut (*s).extra_until };
    *until = 0;
    // The cluster-scoped charge inline (`bucket::charge`): a BPF call from here would stack its
    // frame on this one's and the program's, past the 448 bytes a chain keeps to (CONSTRAINTS.md,
    // "Stack").
    let (v, b) = find_and_charge::<_, false>(key, l, cached, len, now, s, slot, limit, until);
    let until = *until;
    if b.is_null() {
        c.records[k] = NO_RECORD;
        return v;
    }
    // SAFETY: this CPU's classification slot; `k` is in bounds.
    let record = unsafe { (*slot).extra[k] };
    settle(b, v, until, c, k, record)
}

/// `one_limit`'s charge through the record the slot remembers for limit `k + 1` of `rule`, if
/// that record still holds the source's key: the verdict, or `None` (the record is to be found,
/// or created, by `one_limit`). Inlined: no BPF call for a known source.
#[inline(always)]
fn cached_limit(
    pkt: &Packet,
    rule: &Rule,
    slot: *mut ClassSlot,
    c: *mut Extra,
    k: usize,
) -> Option<usize> {
    if k >= MAX_LIMITS - 1 {
        return None;
    }
    // SAFETY: this CPU's classification slot; `k` is in bounds.
    let cached = unsafe { (*slot).extra[k] };
    if cached == NO_RECORD {
        return None;
    }
    let r = BUCKETS.get_ptr_mut(cached)?;
    let l = &rule.extra[k];
    // SAFETY: this CPU's live scratch record, filled by the caller.
    let c = unsafe { &mut *c };
    let key = store::key(pkt, c.id, k as u32 + 1, &l.src_mask, rule.bucket_gen);
    if !store::holds(r, &key) {
        return None;
    }
    if l.flags & rule_flags::CLUSTER != 0 {
        mark_grown(cached, r);
    }
    // The window's end in the scratch record, where a cluster-scoped charge leaves it too: not
    // on the program's frame (CONSTRAINTS.md, "Stack").
    c.until = 0;
    let v = bucket::charge::<_, true>(r, l, c.now, c.len, &mut c.until, &raw mut c.clock);
    let until = c.until;
    Some(settle(r, v, until, c, k, cached))
}

/// What a charge of limit `k + 1` (verdict `v`, record `b` at index `record`) leaves behind: the
/// slot window's drops added to its counter if it was this limit's, the packet counted if
/// dropped (with the window's end in `c.until`), the record in `c.records[k]` if not.
#[inline(always)]
fn settle(b: *mut Bucket, v: usize, until: u64, c: &mut Extra, k: usize, record: u32) -> usize {
    // SAFETY: `b` is a live record.
    unsafe {
        if c.drop_limit == k as u32 + 1 {
            (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(c.drop_count);
        }
    }
    if k >= MAX_LIMITS - 1 {
        return v;
    }
    if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES {
        bucket::count(b, false, c.len);
        c.until = until;
        c.records[k] = NO_RECORD;
    } else {
        c.records[k] = record;
    }
    v
}
