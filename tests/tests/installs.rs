//! Rule sets installed one after another into the real program's maps (`Dataplane::install`,
//! which writes only what changed): after every install both generations of the prefix trie
//! hold exactly the set in force, every rule record and name is the set's, and real frames (through
//! BPF_PROG_TEST_RUN) get the verdict the reference classifier gives.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ratelimit::compile::CompiledRuleSet;
use ratelimit_common::{action, prefix_generation};
use ratelimit_testbed::{
    packet::eth,
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

/// A trie entry as compared: (family, address, LPM length) -> the names of its candidate rules.
type Entries = BTreeMap<(u8, [u8; 16], u32), Vec<String>>;

/// The rule pool: nested and disjoint prefixes of both families.
const POOL: &[&str] = &[
    "10.0.0.0/8",
    "10.1.0.0/16",
    "10.1.2.0/24",
    "10.1.2.3/32",
    "10.2.0.0/16",
    "192.0.2.0/24",
    "192.0.2.128/25",
    "2001:db8::/32",
    "2001:db8:1::/48",
    "2001:db8:1:2::/64",
];

/// Sources probed after each install: inside each pool prefix and outside all of them.
const PROBES: &[&str] = &[
    "10.9.9.9",
    "10.1.9.9",
    "10.1.2.9",
    "10.1.2.3",
    "10.2.0.1",
    "192.0.2.1",
    "192.0.2.200",
    "198.51.100.1",
    "2001:db8:ffff::1",
    "2001:db8:1:ffff::1",
    "2001:db8:1:2::1",
    "2001:db9::1",
];

/// A rule set drawn from the pool: each prefix present with probability 2/3, as a deny, an
/// allow, or a limit (burst far above what a probe sends, so its packets pass) whose rate is
/// drawn from three values (a changed rate is a changed rule), some with a UDP-only sibling.
fn draw(rng: &mut fastrand::Rng) -> String {
    let mut toml = String::new();
    for (i, net) in POOL.iter().enumerate() {
        if rng.u64(..3) == 0 {
            continue;
        }
        match rng.u64(..3) {
            0 => {
                toml +=
                    &format!("[[rule]]\nname = \"p{i}\"\nsource = \"{net}\"\naction = \"deny\"\n")
            }
            1 => {
                toml +=
                    &format!("[[rule]]\nname = \"p{i}\"\nsource = \"{net}\"\naction = \"allow\"\n")
            }
            _ => {
                let rate = 1000 * (1 + rng.u64(..3));
                toml += &format!(
                    "[[rule]]\nname = \"p{i}\"\nsource = \"{net}\"\nrate = {rate}\nburst = 1000000\n"
                );
            }
        }
        if rng.u64(..4) == 0 {
            let act = if rng.u64(..2) == 0 { "deny" } else { "allow" };
            toml += &format!(
                "[[rule]]\nname = \"u{i}\"\nsource = \"{net}\"\nprotocol = \"udp\"\naction = \"{act}\"\n"
            );
        }
    }
    toml
}

/// What the compiled set says each generation must hold.
fn want(set: &CompiledRuleSet) -> Entries {
    set.prefixes
        .iter()
        .map(|p| {
            let names = p
                .candidates()
                .iter()
                .map(|&id| set.rule(id).unwrap().name.clone())
                .collect();
            ((p.family, p.addr, p.lpm_prefix_len()), names)
        })
        .collect()
}

/// What generation `generation` of the pinned trie holds, candidates named through the pinned
/// rule names.
fn held(dp: &TestDataplane, generation: u8) -> Entries {
    let named = dp.maps().named_rules().unwrap();
    dp.maps()
        .prefixes()
        .unwrap()
        .into_iter()
        .filter(|(k, _, _)| k.generation == generation)
        .map(|(k, len, rules)| {
            let names = rules.rules[..rules.len as usize]
                .iter()
                .map(|id| {
                    named
                        .get(id)
                        .map_or(format!("unnamed id {id}"), |n| n.0.clone())
                })
                .collect();
            ((k.family, k.addr, len), names)
        })
        .collect()
}

fn frame(src: IpAddr) -> Vec<u8> {
    match src {
        IpAddr::V4(a) => eth()
            .ipv4(a, Ipv4Addr::new(198, 18, 0, 254))
            .udp(1000, 9)
            .build(),
        IpAddr::V6(a) => eth()
            .ipv6(a, "2001:db8::fe".parse::<Ipv6Addr>().unwrap())
            .udp(1000, 9)
            .build(),
    }
}

#[test]
fn every_install_leaves_both_generations_holding_exactly_the_set_in_force() {
    require_root();
    let mut dp = TestDataplane::new("installs", 4096).unwrap();
    // A fixed sequence of rule sets, the same on every run.
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    let mut sets = vec![String::new()];
    sets.extend((0..40).map(|_| draw(&mut rng)));
    // Then back to nothing, and a set installed twice in a row (nothing to write).
    sets.push(String::new());
    let again = draw(&mut rng);
    sets.push(again.clone());
    sets.push(again);
    for (round, toml) in sets.iter().enumerate() {
        let set = dp.install_toml(toml).unwrap();
        let want = want(&set);
        let active = prefix_generation(dp.maps().config().unwrap().generation);
        for generation in [active, 1 - active] {
            assert_eq!(
                held(&dp, generation),
                want,
                "round {round}: generation {generation} (active {active}) is not the set in \
                 force:\n{toml}"
            );
        }
        // Every rule record and name is the set's (the bucket generation is the data plane's).
        let named = dp.maps().named_rules().unwrap();
        assert_eq!(named.len(), set.rules.len(), "round {round}: {named:?}");
        for r in &set.rules {
            let (name, _, record) = &named[&r.id];
            assert_eq!(name, &r.name, "round {round}");
            assert_eq!(
                ratelimit_common::Rule {
                    bucket_gen: 0,
                    ..*record
                },
                r.rule,
                "round {round}: rule {}",
                r.name
            );
            assert_ne!(record.bucket_gen, 0, "round {round}: rule {}", r.name);
        }
        // Real frames, classified by the set in force.
        for probe in PROBES {
            let src: IpAddr = probe.parse().unwrap();
            let want = match set.classify(src, 17, Some(9), 0) {
                Some(r) if r.rule.action == action::DENY => XDP_DROP,
                _ => XDP_PASS,
            };
            assert_eq!(
                dp.run(&frame(src)),
                want,
                "round {round}: a frame from {src}:\n{toml}"
            );
        }
    }
}

/// `n` per-source limits, each on a /24 of its own under 11.0.0.0/8; rule "r0"'s rate is
/// `rate0` (another value is a changed rule).
fn many(n: usize, rate0: u64) -> String {
    (0..n)
        .map(|i| {
            let rate = if i == 0 { rate0 } else { 1000 };
            format!(
                "[[rule]]\nname = \"r{i}\"\nsource = \"11.{}.{}.0/24\"\nrate = {rate}\nburst = 2000\n",
                i >> 8,
                i & 0xff
            )
        })
        .collect()
}

#[test]
fn a_one_rule_change_writes_that_rule_alone_whatever_the_set_size() {
    require_root();
    let mut dp = TestDataplane::new("installs-one", 4096).unwrap();
    let src: IpAddr = "11.0.1.9".parse().unwrap();
    for n in [10, 1000] {
        let set = dp.install_toml(&many(n, 1000)).unwrap();
        let r1 = set.by_name("r1").unwrap().id;
        // A rule the change leaves alone has counted a packet.
        assert_eq!(dp.run(&frame(src)), XDP_PASS);
        let counted = dp.rule(r1);
        assert!(
            counted.pkts[ratelimit_common::verdict::PASSED] > 0,
            "{n} rules"
        );

        let before = dp.maps().writes();
        let changed = dp.install_toml(&many(n, 1001)).unwrap();
        // r0's new id: its counters zeroed, its record and its name (3); r0's prefix, whose
        // candidate is the new id, in each generation of the trie (2); the switch (1); r0's old
        // id retired: name freed, bucket generation ended (2).
        assert_eq!(
            dp.maps().writes() - before,
            8,
            "{n} rules: a change of one rule wrote more than that rule"
        );
        assert_eq!(changed.by_name("r1").unwrap().id, r1);
        assert_eq!(
            dp.rule(r1),
            counted,
            "{n} rules: r1's counters were touched"
        );
        assert_ne!(
            changed.by_name("r0").unwrap().id,
            set.by_name("r0").unwrap().id
        );

        // The same set again: only the switch to a new epoch.
        let before = dp.maps().writes();
        dp.install_toml(&many(n, 1001)).unwrap();
        assert_eq!(dp.maps().writes() - before, 1, "{n} rules: nothing changed");
        assert_eq!(dp.run(&frame(src)), XDP_PASS);
    }
}
