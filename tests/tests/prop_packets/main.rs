//! Property tests of the real XDP program against a user-space reference model, through
//! BPF_PROG_TEST_RUN.
//!
//! Random rule sets (prefixes from a small pool, so that they nest and overlap; random protocol,
//! port and `tcp_flags = "syn"`; allow, deny, and limit rules with rate 1 and bursts of at most 5 packets, some with a
//! byte limit of 1 byte/s) meet random frames (IPv4 and IPv6, VLAN tags, IPv4 options, IPv6
//! extension headers, fragments, TCP (SYN, SYN-ACK, ACK, ... any flags byte)/UDP/ICMP/other, and
//! then mutations: truncated, bytes flipped,
//! bad IHL or version, retyped headers). For every frame the model
//! - parses it the way `ratelimit-ebpf/src/parse.rs` documents (or names the counter of the reason
//!   it cannot: an unparseable frame must pass, whatever the rules say),
//! - classifies it with [`CompiledRuleSet::classify`], the user-space reference classifier,
//! - charges a model bucket per (rule, source masked to the rule's `per`),
//!
//! and predicts the XDP action, every rule counter and every global counter that moves. The
//! program must agree on all three, frame by frame.
//!
//! Time: at 1 packet/s (and 1 byte/s) a bucket earns its next token one second after it was
//! created, so a bucket younger than that admits exactly `burst` packets (`bytes_burst` bytes) and
//! nothing more. Every case installs rules under new names, so they get fresh ids (or reused ids under a
//! new bucket generation) and the buckets of earlier cases go stale, and a case stops sending after [`CASE_BUDGET`].
//!
//! Deterministic: the seed is fixed; `RL_PROP_SEED=N` replays another, `RL_PROP_CASES=N` runs more
//! cases. A failure prints the seed, the case, its rules as TOML and the frame in hex.

use std::time::{Duration, Instant};

use ratelimit_common::{config_flags, global, verdict, GlobalStats, RuleStats};
use ratelimit_testbed::{
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

mod model;
mod parse;
mod random;

use crate::model::{Expect, Model};
use crate::parse::model_parse;
use crate::random::{mutate, random_frame, random_frame_flags_at, random_rule_set};

/// Default seed (any value; fixed so that CI runs the same cases every time).
const SEED: u64 = 0x005e_ed0f_7e57;
/// Rule sets per run by default, and frames per rule set.
const CASES: usize = 250;
const FRAMES_PER_CASE: usize = 40;
/// A case stops sending after this long: far below the 1 s in which a rate-1 bucket earns a token.
const CASE_BUDGET: Duration = Duration::from_millis(700);
/// Failures printed in full.
const SHOW: usize = 8;

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// Rule prefixes: nested and overlapping on purpose.
const V4_PREFIXES: [&str; 9] = [
    "0.0.0.0/0",
    "198.18.0.0/15",
    "198.18.0.0/16",
    "198.18.1.0/24",
    "198.18.1.0/25",
    "198.18.1.128/25",
    "198.18.1.7/32",
    "198.19.0.0/16",
    "198.18.2.0/24",
];
const V6_PREFIXES: [&str; 6] = [
    "::/0",
    "2001:db8::/32",
    "2001:db8:0:1::/64",
    "2001:db8:0:1::7/128",
    "2001:db8:1::/48",
    "2001:db8:0:1:8000::/65",
];
/// Packet sources: inside the prefixes above at various depths, and outside all but /0.
const V4_SOURCES: [&str; 7] = [
    "198.18.1.7",
    "198.18.1.8",
    "198.18.1.200",
    "198.18.2.3",
    "198.19.5.5",
    "198.18.9.9",
    "192.0.2.1",
];
const V6_SOURCES: [&str; 7] = [
    "2001:db8:0:1::7",
    "2001:db8:0:1::8",
    "2001:db8:0:1:ffff::1",
    "2001:db8:1::5",
    "2001:db8:2::1",
    "2001:db8:1:0:1::1",
    "3fff::1",
];
const PORTS: [u16; 3] = [53, 80, 443];

// ---------------------------------------------------------------------------------------------
// A small deterministic RNG (SplitMix64): no dependency, identical sequences everywhere.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("fits")
    }

    /// True with probability `percent`%.
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn byte(&mut self) -> u8 {
        self.next().to_le_bytes()[0]
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn delta(after: &GlobalStats, before: &GlobalStats) -> [u64; global::COUNT] {
    std::array::from_fn(|i| after.counters[i] - before.counters[i])
}

fn rule_delta(after: &RuleStats, before: &RuleStats) -> [u64; verdict::COUNT] {
    std::array::from_fn(|v| after.pkts[v] - before.pkts[v])
}

#[test]
fn verdicts_and_counters_match_the_reference_model() {
    require_root();
    let seed = env_or("RL_PROP_SEED", SEED);
    let cases = usize::try_from(env_or("RL_PROP_CASES", CASES as u64)).expect("fits");
    let mut rng = Rng(seed);
    let mut dp = TestDataplane::new("prop", 1 << 16).expect("load");
    dp.make_buckets_at_first_packet();
    let started = Instant::now();
    let (mut checked, mut unparseable, mut drops, mut cut_short) = (0usize, 0usize, 0usize, 0usize);
    let mut verdicts = [0usize; verdict::COUNT];
    let mut failures: Vec<String> = Vec::new();
    for case in 0..cases {
        let (toml, config) = random_rule_set(&mut rng, case);
        let agent_dry_run = rng.chance(10);
        let set = dp
            .install_toml(&toml)
            .unwrap_or_else(|e| panic!("case {case}: install: {e:#}\n{toml}"));
        dp.dataplane()
            .set_flags(if agent_dry_run {
                config_flags::DRY_RUN
            } else {
                0
            })
            .expect("set flags");
        let store = dp.maps().config().expect("config");
        let mut model = Model::new(&set, &config, agent_dry_run, &store);
        let ids: Vec<u32> = set.rules.iter().map(|r| r.id).collect();
        let case_start = Instant::now();
        let mut g0 = dp.global();
        let mut r0: Vec<RuleStats> = ids.iter().map(|&id| dp.rule(id)).collect();
        let mut twin: Option<(Vec<u8>, String, usize)> = None;
        for n in 0..FRAMES_PER_CASE {
            if case_start.elapsed() > CASE_BUDGET {
                cut_short += 1;
                break;
            }
            // Now and then the last TCP frame again with other flags: one source's SYNs, SYN-ACKs
            // and ACKs in a row, as the per-CPU classification cache sees them.
            let (bytes, desc) = match twin.take() {
                Some((mut bytes, desc, at)) if rng.chance(70) => {
                    let flags = *rng.pick(&[0x02u8, 0x12, 0x10, 0x18, 0x00]);
                    bytes[at] = flags;
                    (bytes, format!("{desc} (again, flags {flags:#04x})"))
                }
                _ => {
                    let (bytes, desc, at) = random_frame_flags_at(&mut rng);
                    if let Some(at) = at.filter(|&at| at < bytes.len()) {
                        twin = Some((bytes.clone(), desc.clone(), at));
                    }
                    (bytes, desc)
                }
            };
            let want = model.frame(&bytes);
            let action = dp.run(&bytes);
            let g1 = dp.global();
            let r1: Vec<RuleStats> = ids.iter().map(|&id| dp.rule(id)).collect();
            let got_global = delta(&g1, &g0);
            let moved: Vec<(u32, usize)> = ids
                .iter()
                .zip(r0.iter().zip(&r1))
                .flat_map(|(&id, (a, b))| {
                    let d = rule_delta(b, a);
                    (0..verdict::COUNT).flat_map(move |v| {
                        std::iter::repeat_n((id, v), usize::try_from(d[v]).expect("small"))
                    })
                })
                .collect();
            let got = Expect {
                action,
                global: got_global,
                rule: moved.first().copied(),
            };
            checked += 1;
            if model_parse(&bytes).is_err() {
                unparseable += 1;
            }
            if action == XDP_DROP {
                drops += 1;
            }
            if let Some((_, v)) = got.rule {
                verdicts[v] += 1;
            }
            if got != want || moved.len() > 1 {
                let name = |r: Option<(u32, usize)>| {
                    r.map(|(id, v)| {
                        format!(
                            "{} {}",
                            set.rule(id).map_or("?", |c| c.name.as_str()),
                            verdict::NAMES[v]
                        )
                    })
                };
                failures.push(format!(
                    "seed {seed:#x} case {case} frame {n}: {desc}\n  frame ({} bytes) {}\n  model parse: {:?}\n  \
                     action {} (model {}), rule {:?} (model {:?}, all moved {moved:?})\n  global deltas {:?}\n  \
                     model          {:?}\n  agent dry run {agent_dry_run}; rules:\n{toml}",
                    bytes.len(),
                    hex(&bytes),
                    model_parse(&bytes),
                    action,
                    want.action,
                    name(got.rule),
                    name(want.rule),
                    got.global,
                    want.global,
                ));
            }
            g0 = g1;
            r0 = r1;
        }
    }
    dp.dataplane().set_flags(0).expect("set flags");
    println!(
        "{checked} frames in {cases} rule sets in {:?} (seed {seed:#x}): {unparseable} unparseable, {drops} \
         dropped; rule verdicts {:?} = {verdicts:?}; {cut_short} cases cut short by the time budget",
        started.elapsed(),
        verdict::NAMES
    );
    let shown: Vec<&String> = failures.iter().take(SHOW).collect();
    assert!(
        failures.is_empty(),
        "{} of {checked} frames disagree with the model; the first {}:\n\n{}",
        failures.len(),
        shown.len(),
        shown
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The generator must reach every outcome, or the property says little.
    assert!(
        checked >= cases * FRAMES_PER_CASE * 9 / 10,
        "only {checked} frames checked"
    );
    for v in [
        verdict::PASSED,
        verdict::ALLOWED,
        verdict::DROPPED_RATE,
        verdict::DROPPED_BYTES,
        verdict::DENIED,
        verdict::DRY_RUN,
    ] {
        assert!(
            verdicts[v] > 0,
            "no frame got verdict {}: {verdicts:?}",
            verdict::NAMES[v]
        );
    }
    assert!(
        unparseable * 20 > checked,
        "too few unparseable frames: {unparseable} of {checked}"
    );
}

/// With a rule that denies every source of both families, whatever the protocol: every frame
/// the model parses is dropped and every frame it cannot parse passes, counted under its reason.
#[test]
fn unparseable_frames_pass_even_when_everything_is_denied() {
    require_root();
    let seed = env_or("RL_PROP_SEED", SEED) ^ 0xdead;
    let mut rng = Rng(seed);
    let mut dp = TestDataplane::new("propdeny", 1024).expect("load");
    dp.make_buckets_at_first_packet();
    dp.install_toml(
        "[[rule]]\nname = \"deny-all\"\nsource = [\"0.0.0.0/0\", \"::/0\"]\naction = \"deny\"\n",
    )
    .expect("install");
    let frames = 3000;
    let mut failures = Vec::new();
    let mut reasons = [0usize; global::COUNT];
    for n in 0..frames {
        let (mut bytes, mut desc) = random_frame(&mut rng);
        // Damage every other frame some more.
        if n % 2 == 0 {
            mutate(&mut rng, &mut bytes, 14, false, &mut desc);
        }
        let g0 = dp.global();
        let action = dp.run(&bytes);
        let got = delta(&dp.global(), &g0);
        match model_parse(&bytes) {
            // Past the VLAN walk: its source is unknown, and the deny rule could apply.
            Err(reason @ global::DROPPED_VLAN_CHAINS) => {
                reasons[reason] += 1;
                if action != XDP_DROP || got[reason] != 1 {
                    failures.push(format!(
                        "frame {n} ({desc}): past the VLAN walk but action {action}, global deltas {got:?}\n  {}",
                        hex(&bytes)
                    ));
                }
            }
            Err(reason) => {
                reasons[reason] += 1;
                if action != XDP_PASS || got[reason] != 1 {
                    failures.push(format!(
                        "frame {n} ({desc}): unparseable ({}) but action {action}, global deltas {got:?}\n  {}",
                        global::NAMES[reason],
                        hex(&bytes)
                    ));
                }
            }
            Ok(p) if action != XDP_DROP => failures.push(format!(
                "frame {n} ({desc}): parsed as {p:?} but not dropped (action {action}, global deltas {got:?})\n  {}",
                hex(&bytes)
            )),
            Ok(_) => {}
        }
    }
    println!(
        "{frames} frames (seed {seed:#x}); unparseable by reason: {:?}",
        global::NAMES
            .iter()
            .zip(reasons)
            .filter(|(_, n)| *n > 0)
            .collect::<Vec<_>>()
    );
    assert!(
        failures.is_empty(),
        "{} failures, first:\n{}",
        failures.len(),
        failures
            .iter()
            .take(SHOW)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    for reason in [
        global::NON_IP,
        global::BAD_VLAN,
        global::TRUNCATED_IPV4,
        global::BAD_IPV4,
        global::BAD_IPV6,
    ] {
        assert!(
            reasons[reason] > 0,
            "no frame was unparseable for {}: {reasons:?}",
            global::NAMES[reason]
        );
    }
}
