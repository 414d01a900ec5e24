//! The IPv4 table of the real XDP program (BPF_PROG_TEST_RUN): a new IPv4 source classified from
//! its /16's word where the trie's outcome is one for the whole /16, the table following every
//! install, and a wrong word repaired by the next.

use ratelimit_testbed::{
    packet::{ip, udp4},
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

/// The rule a packet from `src` (UDP to port 9) was counted under: the one whose allowed or
/// denied count moved by one over the run, with the run's action.
fn counted_under(
    dp: &TestDataplane,
    set: &ratelimit::compile::CompiledRuleSet,
    src: &str,
) -> (Option<String>, u32) {
    let before: Vec<_> = set.rules.iter().map(|r| dp.rule(r.id).pkts).collect();
    let action = dp.run(&udp4(ip(src)));
    let moved: Vec<String> = set
        .rules
        .iter()
        .zip(before)
        .filter(|(r, b)| dp.rule(r.id).pkts != *b)
        .map(|(r, _)| r.name.clone())
        .collect();
    assert!(moved.len() <= 1, "{src} counted under {moved:?}");
    (moved.into_iter().next(), action)
}

/// The IPv4 table's half the rule set in force lives in.
fn half_in_force(dp: &TestDataplane) -> u8 {
    ratelimit_common::prefix_generation(dp.maps().config().unwrap().generation)
}

/// Where the word of the /16 of `src` is in a half of the IPv4 table.
fn slot_of(src: &str) -> usize {
    let [a, b, _, _] = ip(src).octets();
    ratelimit_common::v4_table::index(0, [a, b]) as usize
}

/// The word of the IPv4 table's half in force for the /16 of `src`.
fn table_word(dp: &TestDataplane, src: &str) -> u32 {
    dp.maps().v4_table().half(half_in_force(dp))[slot_of(src)]
}

/// The IPv4 table (one word per /16, read before the trie) gives each packet the rule the trie's
/// walk gives it, and follows every install: sources in /16s whose word holds the outcome
/// (covered by a /0, a /8 or a /16 with nothing longer inside) and in /16s that fall back to the
/// trie (a /24 inside, a port rule first), checked against the reference walk and by the rule
/// counters, before and after a swap that turns words both ways.
#[test]
fn the_ipv4_table_classifies_as_the_trie_across_installs() {
    use ratelimit_common::v4_table::{direct, TRIE};
    require_root();
    let mut dp = TestDataplane::new("v4table", 1024).unwrap();
    let allow = |name: &str, source: &str| {
        format!("[[rule]]\nname = \"{name}\"\nsource = \"{source}\"\naction = \"allow\"\n\n")
    };
    let deny = |name: &str, source: &str| {
        format!("[[rule]]\nname = \"{name}\"\nsource = \"{source}\"\naction = \"deny\"\n\n")
    };
    let dns = "[[rule]]\nname = \"dns\"\nsource = \"10.2.0.0/16\"\nprotocol = \"udp\"\n\
               dst_port = 9\naction = \"deny\"\n\n";
    let first = [
        allow("all", "0.0.0.0/0"),
        allow("ten", "10.0.0.0/8"),
        deny("ten-one", "10.1.0.0/16"),
        allow("ten-one-two", "10.1.2.0/24"),
        dns.to_string(),
    ]
    .concat();
    let second = [
        deny("all", "0.0.0.0/0"),
        deny("ten-one", "10.1.0.0/16"),
        allow("ten-three", "10.3.0.0/24"),
    ]
    .concat();
    // (source, the rule it falls under, whether its /16's word holds the outcome)
    type Source<'a> = (&'a str, &'a str, bool);
    let cases: [(&str, &[Source]); 2] = [
        (
            &first,
            &[
                ("192.0.2.1", "all", true),
                ("10.200.0.1", "ten", true),
                ("10.3.0.1", "ten", true),
                ("10.1.0.1", "ten-one", false),
                ("10.1.2.1", "ten-one-two", false),
                ("10.2.0.1", "dns", false),
            ],
        ),
        (
            &second,
            &[
                ("192.0.2.2", "all", true),
                ("10.200.0.2", "all", true),
                ("10.1.2.2", "ten-one", true),
                ("10.2.0.2", "all", true),
                ("10.3.0.2", "ten-three", false),
                ("10.3.1.2", "all", false),
            ],
        ),
    ];
    for (rules, sources) in cases {
        let set = dp.install_toml(rules).unwrap();
        for &(src, rule, held) in sources {
            let want = set.by_name(rule).unwrap();
            let walk = set.classify(ip(src).into(), 17, Some(9), 0).map(|r| r.id);
            assert_eq!(
                walk,
                Some(want.id),
                "the reference walk puts {src} under {rule}"
            );
            let word = table_word(&dp, src);
            if held {
                assert_eq!(word, direct(Some(want.id)), "{src}'s /16 holds its outcome");
            } else {
                assert_eq!(word, TRIE, "{src}'s /16 falls back to the trie");
            }
            let action = if want.rule.action == ratelimit_common::action::DENY {
                XDP_DROP
            } else {
                XDP_PASS
            };
            assert_eq!(
                counted_under(&dp, &set, src),
                (Some(rule.to_string()), action),
                "{src}"
            );
        }
        // Both halves hold the set in force once the install is over.
        let maps = dp.maps();
        assert_eq!(maps.v4_table().half(0), maps.v4_table().half(1));
        assert_eq!(maps.v4_table().half(0), set.v4_table());
    }
}

/// The program reads the IPv4 table before the trie: a word planted in the half in force sends
/// its /16's new sources to the planted rule (so the table, not the trie, decided), and the next
/// install, of the same rules, finds and repairs it.
#[test]
fn a_planted_ipv4_table_word_is_followed_and_repaired_by_the_next_install() {
    use ratelimit_common::v4_table::direct;
    require_root();
    let mut dp = TestDataplane::new("v4plant", 1024).unwrap();
    let rules = "[[rule]]\nname = \"all\"\nsource = \"0.0.0.0/0\"\naction = \"allow\"\n\n\
                 [[rule]]\nname = \"ten\"\nsource = \"10.0.0.0/8\"\naction = \"deny\"\n";
    let set = dp.install_toml(rules).unwrap();
    assert_eq!(
        counted_under(&dp, &set, "10.200.0.1"),
        (Some("ten".into()), XDP_DROP)
    );
    {
        let half = half_in_force(&dp);
        let table = dp.maps().v4_table();
        let mut words = table.half(half);
        words[slot_of("10.200.0.0")] = direct(Some(set.by_name("all").unwrap().id));
        assert_eq!(table.write_half(half, &words), 1);
    }
    assert_eq!(
        counted_under(&dp, &set, "10.200.0.2"),
        (Some("all".into()), XDP_PASS),
        "the planted word decides"
    );
    assert_eq!(
        counted_under(&dp, &set, "10.201.0.2"),
        (Some("ten".into()), XDP_DROP)
    );
    let again = dp.install_toml(rules).unwrap();
    assert_eq!(
        again.by_name("ten").unwrap().id,
        set.by_name("ten").unwrap().id
    );
    assert_eq!(
        table_word(&dp, "10.200.0.3"),
        direct(Some(set.by_name("ten").unwrap().id))
    );
    assert_eq!(
        counted_under(&dp, &again, "10.200.0.3"),
        (Some("ten".into()), XDP_DROP)
    );
}
