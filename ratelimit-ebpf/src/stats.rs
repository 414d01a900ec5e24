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

#[inline(always)]
pub fn count_rule(rule: u32, verdict: usize, len: u64) {
    if verdict >= verdict::COUNT {
        return;
    }
    if let Some(s) = RULE_STATS.get_ptr_mut(rule) {
        // SAFETY: as above.
        unsafe {
            (*s).pkts[verdict] += 1;
            (*s).bytes[verdict] += len;
        }
    }
}

/// Counts a drop by limit `limit` of rule `rule` (verdict `DROPPED_RATE` or `DROPPED_BYTES`).
#[inline(always)]
pub fn count_limit(rule: u32, verdict: usize, limit: usize) {
    let limit = limit & (MAX_LIMITS - 1);
    if let Some(s) = RULE_STATS.get_ptr_mut(rule) {
        // SAFETY: as above; `limit` is masked into bounds.
        unsafe {
            if verdict == verdict::DROPPED_RATE {
                (*s).limit_dropped_rate[limit] += 1;
            } else if verdict == verdict::DROPPED_BYTES {
                (*s).limit_dropped_bytes[limit] += 1;
            }
        }
    }
}
