// This module's documentation is on its declaration in lib.rs, where its links resolve.

use core::mem::{align_of, offset_of, size_of};

use super::{
    global, map_names, verdict, Bucket, Config, GlobalStats, Limit, PrefixKey, Rule, RuleMeta,
    RuleSet, RuleStats, BPF_F_MMAPABLE,
};

/// Bumped by hand when a pinned field, counter or flag changes meaning without changing the
/// layout.
pub const EPOCH: u64 = 8;

/// `BPF_MAP_TYPE_ARRAY`.
pub const MAP_ARRAY: u32 = 2;
/// `BPF_MAP_TYPE_PERCPU_ARRAY`.
pub const MAP_PERCPU_ARRAY: u32 = 6;
/// `BPF_MAP_TYPE_LPM_TRIE`.
pub const MAP_LPM_TRIE: u32 = 11;
/// `BPF_F_NO_PREALLOC`, which an LPM trie requires.
pub const BPF_F_NO_PREALLOC: u32 = 1;

/// Every pinned map: (name, map type, map flags).
pub const PINNED_MAPS: [(&str, u32, u32); 10] = [
    (map_names::CONFIG, MAP_ARRAY, 0),
    (map_names::RULES, MAP_ARRAY, 0),
    (map_names::RULE_META, MAP_ARRAY, 0),
    (map_names::PREFIXES, MAP_LPM_TRIE, BPF_F_NO_PREALLOC),
    (map_names::BUCKETS, MAP_ARRAY, BPF_F_MMAPABLE),
    (map_names::RULE_STATS, MAP_PERCPU_ARRAY, 0),
    (map_names::GLOBAL_STATS, MAP_PERCPU_ARRAY, 0),
    (map_names::V4_TABLE, MAP_ARRAY, BPF_F_MMAPABLE),
    (map_names::NEW_PAGES, MAP_ARRAY, BPF_F_MMAPABLE),
    (map_names::BUCKET_TAGS, MAP_ARRAY, BPF_F_MMAPABLE),
];

/// This version's stamp.
pub const STAMP: u32 = stamp();

/// 64-bit FNV-1a step over the eight bytes of `v`.
const fn fnv(mut h: u64, v: u64) -> u64 {
    let bytes = v.to_le_bytes();
    let mut i = 0;
    while i < 8 {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
}

const fn fnv_str(mut h: u64, s: &str) -> u64 {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        h = fnv(h, bytes[i] as u64);
        i += 1;
    }
    fnv(h, bytes.len() as u64)
}

/// Folds a type's size, alignment and the offset of each named field into the hash.
macro_rules! record {
    ($h:expr, $t:ty; $($field:ident),+) => {{
        let mut h = fnv($h, size_of::<$t>() as u64);
        h = fnv(h, align_of::<$t>() as u64);
        $( h = fnv(h, offset_of!($t, $field) as u64); )+
        h
    }};
}

const fn stamp() -> u32 {
    let mut h = fnv(0xcbf2_9ce4_8422_2325, EPOCH);
    h = record!(h, Config; generation, flags, seed, bucket_sets, layout, shares_until_ns);
    h = record!(h, PrefixKey; generation, family, addr);
    h = record!(h, RuleSet; len, rules);
    h = record!(
        h, Rule; action, protocol, dst_port, flags, src_mask, pkt_interval_ns,
        pkt_tolerance_ns, byte_interval_fp, byte_tolerance_ns, bucket_gen, tcp_mask, tcp_flags,
        extra_len, _pad, extra
    );
    h = record!(
        h, Limit; flags, _pad, src_mask, pkt_interval_ns, pkt_tolerance_ns, byte_interval_fp,
        byte_tolerance_ns
    );
    h = record!(
        h, Bucket; addr, rule, family, state, rule_gen, tat_ns, byte_tat_ns, created_share,
        passed_bytes, passed_pkts, dropped_pkts
    );
    h = record!(h, RuleMeta; name_len, line, name);
    h = record!(h, RuleStats; pkts, bytes, limit_dropped_rate, limit_dropped_bytes);
    h = record!(h, GlobalStats; counters);
    h = fnv(h, global::COUNT as u64);
    h = fnv(h, verdict::COUNT as u64);
    let mut i = 0;
    while i < PINNED_MAPS.len() {
        let (name, kind, flags) = PINNED_MAPS[i];
        h = fnv_str(h, name);
        h = fnv(h, kind as u64);
        h = fnv(h, flags as u64);
        i += 1;
    }
    // Never 0, which marks pins not initialised yet.
    let folded = (h ^ (h >> 32)) as u32;
    if folded == 0 {
        1
    } else {
        folded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    struct Before {
        a: u64,
        b: u64,
        c: u32,
        d: u32,
    }
    /// `Before` with two fields swapped and one narrowed pair merged: same size.
    #[repr(C)]
    struct Swapped {
        b: u64,
        a: u64,
        c: u32,
        d: u32,
    }
    #[repr(C)]
    struct Merged {
        a: u64,
        b: u64,
        c: u64,
        d: [u8; 0],
    }

    #[test]
    fn the_stamp_sees_fields_moved_at_the_same_size() {
        assert_eq!(size_of::<Before>(), size_of::<Swapped>());
        assert_eq!(size_of::<Before>(), size_of::<Merged>());
        let before = record!(1, Before; a, b, c, d);
        assert_ne!(before, record!(1, Swapped; a, b, c, d));
        assert_ne!(before, record!(1, Merged; a, b, c, d));
        assert_eq!(before, record!(1, Before; a, b, c, d));
        assert_ne!(STAMP, 0);
    }
}
