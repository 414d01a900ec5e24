//! Per-CPU counters. Plain (non-atomic) increments: each CPU owns its copy and XDP runs with
//! preemption disabled, so nothing else writes it meanwhile.

use ratelimit_common::{global, verdict, MAX_LIMITS};

use crate::maps::{GLOBAL_STATS, RULE_STATS};

#[inline(always)]
pub fn bump_global(index: usize) {
    if index >= global::COUNT {
        return;
    }
    if let Some(g) = GLOBAL_STATS.get_ptr_mut(0) {
        // SAFETY: a per-CPU slot, see the module doc; index bounds checked above.
        unsafe { (*g).counters[index] += 1 };
    }
}

/// Counts a packet of rule `rule` under `verdict` (`len` bytes); a rate or byte drop (the verdict
/// the program turns into a drop, before dry run) also under the limit `limit` that dropped it.
/// One lookup of the rule's counters for both.
#[inline(always)]
pub fn count_rule(rule: u32, verdict: usize, len: u64, dropped: usize, limit: usize) {
    if verdict >= verdict::COUNT {
        return;
    }
    let limit = limit & (MAX_LIMITS - 1);
    if let Some(s) = RULE_STATS.get_ptr_mut(rule) {
        // SAFETY: a per-CPU slot, see the module doc; `verdict` bounds checked above, `limit`
        // masked into bounds.
        unsafe {
            (*s).pkts[verdict] += 1;
            (*s).bytes[verdict] += len;
            if dropped == verdict::DROPPED_RATE {
                (*s).limit_dropped_rate[limit] += 1;
            } else if dropped == verdict::DROPPED_BYTES {
                (*s).limit_dropped_bytes[limit] += 1;
            }
        }
    }
}
