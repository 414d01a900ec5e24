//! Per-CPU counters. Plain (non-atomic) increments: each CPU owns its copy and XDP runs with
//! preemption disabled, so nothing else writes it meanwhile.

use ratelimit_common::{global, verdict};

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
