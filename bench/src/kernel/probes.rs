//! Probes: programs that do one operation of the limiter's fast path (a clock, a map lookup)
//! and pass, each against the XDP_PASS floor in the same run: where the time goes.

use anyhow::{bail, Result};
use aya::programs::Xdp;
use ratelimit::maps::store::Slot;
use ratelimit_common::{map_names, BucketKey};
use serde_json::json;

use super::{pinned, repeat_ns, v4_frame, Limiter, TRUNCATION};
use crate::{
    progs::{self, Probe},
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
};

const SECTION_PROBES: &str =
    "Where the time goes: probes doing one operation of the fast path, then XDP_PASS (BPF_PROG_TEST_RUN)";

/// Bytes of a plain-old-data key.
fn key_bytes<T: Copy>(key: &T) -> Vec<u8> {
    // SAFETY: `T` is one of the #[repr(C)] key types of ratelimit-common, without padding.
    unsafe {
        std::slice::from_raw_parts(
            std::ptr::from_ref(key).cast::<u8>(),
            std::mem::size_of::<T>(),
        )
        .to_vec()
    }
}

/// The prefix trie key the limiter looks up for IPv4 source `src` under `generation`.
fn prefix_key(generation: u32, src: [u8; 4]) -> Vec<u8> {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&src);
    let mut key = (ratelimit_common::PREFIX_KEY_HEADER_BITS + 32)
        .to_ne_bytes()
        .to_vec();
    key.extend(key_bytes(&ratelimit_common::PrefixKey {
        generation: ratelimit_common::prefix_generation(generation),
        family: 4,
        addr,
    }));
    key
}

/// Probes: programs that do one operation of the limiter's fast path and pass, each measured
/// against the floor in the same run. `tag`/`what` say which rule set and population are in the
/// maps; `clocks` adds the two clock probes.
pub fn probes(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    tag: &str,
    what: &str,
    clocks: bool,
) -> Result<()> {
    crate::session::announce(&format!("probes of the fast path's parts ({what})"));
    let hot_src = [198, 18, 0, 1];
    let programs = load_probes(limiter, refs, hot_src, (tag, what), clocks)?;
    let frame = v4_frame(hot_src);
    let floor_key = format!("kernel.probe_floor.{tag}");
    let mut floor = Vec::new();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); programs.len()];
    for _ in 0..opts.runs {
        crate::session::check_interrupted()?;
        floor.push(repeat_ns(refs.program(PASS), &frame, opts.repeat)?.0 + TRUNCATION);
        for (i, (key, _, prog)) in programs.iter().enumerate() {
            let (ns, _, action) = repeat_ns(prog, &frame, opts.repeat)?;
            if action != 2 {
                bail!("probe {key} did not pass (its lookup missed?)");
            }
            runs[i].push(ns + TRUNCATION);
        }
    }
    report.add(Figure {
        key: floor_key.clone(),
        section: SECTION_PROBES,
        label: format!("floor: XDP_PASS ({what})"),
        unit: "ns/pkt",
        runs: floor,
        baseline: None,
        detail: json!({ "repeat": opts.repeat }),
    });
    for ((key, label, _), runs) in programs.into_iter().zip(runs) {
        report.add(Figure {
            key: format!("kernel.probe.{key}"),
            section: SECTION_PROBES,
            label,
            unit: "ns/pkt",
            runs,
            baseline: Some(floor_key.clone()),
            detail: json!({ "repeat": opts.repeat }),
        });
    }
    Ok(())
}

/// The probes to run, loaded, as (key, label, program): the clocks and the lookups of the global
/// counters and of a rule if `clocks`, and always the prefix trie's and the bucket store's
/// lookups of the hot source `hot_src` (its bucket made first if it has none). Loaded here,
/// while the maps whose descriptors their instructions hold are open.
fn load_probes(
    limiter: &Limiter,
    refs: &Refs,
    hot_src: [u8; 4],
    (tag, what): (&str, &str),
    clocks: bool,
) -> Result<Vec<(String, String, Xdp)>> {
    use std::os::fd::AsFd as _;
    let generation = limiter.tdp.maps().config()?.generation;
    let admit = limiter.id("admit")?;
    let prefixes = pinned(limiter, map_names::PREFIXES)?;
    let buckets = pinned(limiter, map_names::BUCKETS)?;
    let stats = pinned(limiter, map_names::GLOBAL_STATS)?;
    let rules = pinned(limiter, map_names::RULES)?;
    // Make sure the hot source's bucket exists, and find its record.
    repeat_ns(limiter.program(), &v4_frame(hot_src), 10)?;
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&hot_src);
    let key = BucketKey {
        rule: admit,
        family: 4,
        _pad: [0; 3],
        addr,
    };
    let (Slot::Found(record), _) = limiter.tdp.maps().locate_bucket(&key, 0)? else {
        bail!("the hot source has no bucket in the store");
    };
    let record_key = record.to_ne_bytes();
    let prefix_key = prefix_key(generation, hot_src);
    let zero = 0u32.to_ne_bytes();
    let admit_key = admit.to_ne_bytes();
    let mut list: Vec<(String, String, Vec<progs::Insn>)> = Vec::new();
    if clocks {
        let lookups = [
            ("clock", "bpf_ktime_get_ns()", progs::probe(Probe::Clock)),
            (
                "coarse_clock",
                "bpf_ktime_get_coarse_ns()",
                progs::probe(Probe::CoarseClock),
            ),
            ("jiffies", "bpf_jiffies64()", progs::probe(Probe::Jiffies)),
            (
                "stats_lookup",
                "per-CPU array lookup (global counters)",
                progs::probe(Probe::Lookup(stats.fd().as_fd(), &zero)),
            ),
            (
                "rule_lookup",
                "array lookup (rule record)",
                progs::probe(Probe::Lookup(rules.fd().as_fd(), &admit_key)),
            ),
        ];
        list.extend(lookups.map(|(k, l, insns)| (k.to_owned(), l.to_owned(), insns)));
    }
    list.push((
        format!("prefix_lookup.{tag}"),
        format!("prefix trie lookup, hit ({what})"),
        progs::probe(Probe::Lookup(prefixes.fd().as_fd(), &prefix_key)),
    ));
    list.push((
        format!("bucket_record.{tag}"),
        format!("bucket store: array lookup of the record ({what})"),
        progs::probe(Probe::Lookup(buckets.fd().as_fd(), &record_key)),
    ));
    list.into_iter()
        .map(|(k, l, insns)| {
            let prog = progs::load(&format!("rlb_{}", k.replace('.', "_")), &insns, refs.dir())?;
            Ok((k, l, prog))
        })
        .collect()
}
