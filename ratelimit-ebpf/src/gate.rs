//! A per-rule limit's drop window ([`rule_flags::GATE`]): checked from this CPU's window slot
//! before any limit is charged, from the limit's bucket once the window is over, and opened after
//! the limit drops a packet for its rate.

use ratelimit_common::{extra_index, rule_flags, share, verdict, Rule};

use crate::{
    bucket,
    find::charge_clock,
    maps::BUCKETS,
    parse::Packet,
    scratch::{self, ClassSlot, GateSlot, Scratch, NO_RECORD, SLOT_VALID},
    store,
};

/// Whether the per-rule limit `k` of `rule` (see [`rule_flags::GATE`]) drops the packet before
/// any limit is charged, once this CPU's window for the rule is over or its batch spent (`limit`
/// drops from the window itself, up to [`DROP_BATCH`] in a row): from the limit's bucket (found in
/// the record the window remembers, if it still holds the key): its TAT says whether a packet
/// would conform, as `bucket::charge` judges it, and a drop renews the window (a token closes
/// it). The verdict word of the drop (`DROPPED_RATE`, limit `k` in bits 8..), or 0: charge the
/// limits in order.
///
/// A BPF call (the packet's context in the scratch record's `Extra`) whose verdict `limit`
/// launders (CONSTRAINTS.md, "Instruction budget"), made only for a window that is over or whose
/// batch is spent (once per [`DROP_BATCH`] drops, or per token).
#[inline(never)]
pub fn gate(pkt: &Packet, rule: &Rule) -> usize {
    let Some(s) = scratch::get() else {
        return 0;
    };
    // SAFETY: this CPU's live scratch record, filled by the caller.
    let (id, len, now) = unsafe {
        let c = &raw const (*s).extra;
        ((*c).id, (*c).len, (*c).now)
    };
    let k = rule_flags::gate_limit(rule.flags);
    let drop = verdict::DROPPED_RATE | (k as usize) << 8;
    // The caller found the slot valid for this rule, epoch and family, and its window over or
    // its batch spent: look at the bucket.
    let g = gate_slot(s, id);
    // SAFETY: this CPU's live scratch record (XDP runs with preemption disabled).
    let (count, record) = unsafe { ((*g).drop_count, (*g).record) };
    let Some(b) = BUCKETS.get_ptr_mut(record) else {
        return 0;
    };
    let (interval, tolerance, flags) = if k == 0 {
        (rule.pkt_interval_ns, rule.pkt_tolerance_ns, rule.flags)
    } else {
        let l = &rule.extra[extra_index(k as usize)];
        (l.pkt_interval_ns, l.pkt_tolerance_ns, l.flags)
    };
    let key = store::key(pkt, id, k, &[0; 4], rule.bucket_gen);
    if !store::holds(b, &key) {
        // SAFETY: as above.
        unsafe { (*g).flags = 0 };
        return 0;
    }
    // On the precise clock, whatever the rule's: the lagging coarse one could drop a packet the
    // charge would admit (see `bucket::clock`). Once per window, not per packet.
    let now = if flags & rule_flags::COARSE_CLOCK != 0 {
        scratch::precise_now(charge_clock(s))
    } else {
        now
    };
    // SAFETY: `b` is a live record holding the limit's bucket; as above for `g`.
    unsafe {
        (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(count);
        (*g).drop_count = 0;
        let tat = core::ptr::read_volatile(&raw const (*b).tat_ns);
        // A cluster-scoped limit's TAT kept in its share's time (`ratelimit_common::share`) is
        // judged in that time, as the charge judges it: read at the whole rate it would look
        // further in debt than it is. `shares_until` is as this CPU's last charge read it: a TAT
        // of another time than the one that gives is left to the charge, in order; either time
        // reads the bucket's tokens alike. A TAT at the whole rate is judged at it: where a share
        // is in force the charge brings it into the share's time with its tokens.
        let (interval, tolerance) =
            if flags & rule_flags::CLUSTER != 0 && tat & share::STRETCHED != 0 {
                let dom = bucket::domain_of(b, flags, now, charge_clock(s));
                if !share::same_time(tat, dom) {
                    (*g).flags = 0;
                    return 0;
                }
                let cost = share::cost(interval, dom);
                (cost, share::pkt_tolerance(tolerance, interval, cost, dom))
            } else {
                (interval, tolerance)
            };
        let next = if tat > now { tat } else { now } + interval;
        if next - now > tolerance {
            bucket::count(b, false, len);
            (*g).drop_until = bucket::window_end(flags, next - tolerance, now);
            return drop;
        }
        if next + interval - now <= tolerance {
            // Tokens for this packet and the next: the window closes (charged in order until
            // the limit drops again).
            (*g).flags = 0;
        } else {
            // This packet's token only: the window stays, over, so the next packet comes back
            // here. Under a flood, that one is dropped before any limit is charged: closed, the
            // window would let it be charged to the limits before this one (a new source's
            // bucket made, then its charge given back when this limit drops it).
            (*g).drop_until = 0;
        }
    }
    0
}

/// This CPU's window slot of rule `id` (see [`GateSlot`]).
#[inline(always)]
pub fn gate_slot(s: *mut Scratch, id: u32) -> *mut GateSlot {
    // SAFETY: this CPU's live scratch record; the index is masked into bounds.
    unsafe { &raw mut (*s).gate[id as usize & (scratch::GATE_SLOTS - 1)] }
}

/// After a drop (verdict word `d`, the limit in bits 8..), opens this CPU's window for the rule's
/// per-rule limit (see [`gate`]) if that limit dropped the packet for its rate: its bucket is in
/// the record the slot remembers for it, without a token before `until`. The rule's id and epoch
/// are in the scratch record's `Extra` (see `limit`). A BPF call, as [`gate`]: it runs once per
/// window, not per packet.
#[inline(never)]
pub fn open_gate(rule: &Rule, slot: *mut ClassSlot, d: usize, until: u64) {
    let mut until = until;
    let dropper = d >> 8;
    if dropper != 0 && d & 0xff == verdict::DROPPED_RATE {
        // An extra limit dropped the packet (`limit`'s path for them set the scratch record's
        // `now` for this packet): a cluster-scoped one's window is capped here
        // (`bucket::window_end`), off the full frames (CONSTRAINTS.md, "Stack").
        if let Some(s) = scratch::get() {
            // SAFETY: this CPU's live scratch record and classification slot.
            unsafe {
                let flags = rule.extra[extra_index(dropper)].flags;
                until = bucket::window_end(flags, until, (*s).extra.now);
                (*slot).drop_until = until;
            }
        }
    }
    let k = rule_flags::gate_limit(rule.flags) as usize;
    if rule.flags & rule_flags::GATE == 0 || d & 0xff != verdict::DROPPED_RATE || d >> 8 != k {
        return;
    }
    // SAFETY: this CPU's classification slot; the index is masked into bounds.
    let record = unsafe {
        if k == 0 {
            (*slot).bucket
        } else {
            (*slot).extra[extra_index(k)]
        }
    };
    if record == NO_RECORD {
        return;
    }
    let Some(s) = scratch::get() else {
        return;
    };
    // SAFETY: this CPU's live scratch record.
    let (id, epoch, now) = unsafe { ((*s).extra.id, (*s).extra.epoch, (*s).extra.now) };
    let flags = if k == 0 {
        rule.flags
    } else {
        rule.extra[extra_index(k)].flags
    };
    let until = bucket::window_end(flags, until, now);
    let g = gate_slot(s, id);
    // SAFETY: as above.
    unsafe {
        (*g).epoch = epoch;
        (*g).rule = id;
        (*g).flags = SLOT_VALID;
        (*g).record = record;
        (*g).drop_until = until;
        (*g).drop_count = 0;
    }
}
