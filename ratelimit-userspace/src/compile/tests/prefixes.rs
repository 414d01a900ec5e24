//! The prefix trie's keys and candidate lists: longest prefix first, the most specific rule of a
//! prefix, inherited and shadowed rules, prefix lists, and the bounds on candidates, rules and
//! prefixes.

use super::*;

#[test]
fn lpm_keys() {
    let set = build(&[
        limit("a", "192.0.2.0/24", 1),
        limit("b", "2001:db8::/32", 1),
    ]);
    let v4 = set
        .prefixes
        .iter()
        .find(|p| p.family == family::V4)
        .unwrap();
    assert_eq!(v4.cidr_len, 24);
    assert_eq!(v4.addr, [192, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(v4.lpm_prefix_len(), PREFIX_KEY_HEADER_BITS + 24);
    assert_eq!(
        v4.key(1),
        PrefixKey {
            generation: 1,
            family: family::V4,
            addr: v4.addr
        }
    );
    let key = v4.lpm_key(1);
    assert_eq!((key.prefix_len(), key.data()), (40, v4.key(1)));
    assert_eq!(v4.net(), net("192.0.2.0/24"));
    let v6 = set
        .prefixes
        .iter()
        .find(|p| p.family == family::V6)
        .unwrap();
    assert_eq!(v6.addr, "2001:db8::".parse::<Ipv6Addr>().unwrap().octets());
    assert_eq!(v6.net(), net("2001:db8::/32"));
}

#[test]
fn longest_prefix_wins() {
    let set = build(&[
        limit("world", "0.0.0.0/0", 1000),
        limit("corp", "10.0.0.0/8", 100),
        with_action("office", "10.1.2.0/24", Action::Allow),
        with_action("bad", "10.1.2.3/32", Action::Deny),
    ]);
    assert_eq!(name_of(&set, "192.0.2.1", TCP, Some(80)), Some("world"));
    assert_eq!(name_of(&set, "10.9.9.9", UDP, Some(53)), Some("corp"));
    assert_eq!(name_of(&set, "10.1.2.4", ICMP, None), Some("office"));
    assert_eq!(name_of(&set, "10.1.2.3", TCP, Some(22)), Some("bad"));
    // Each list ends with its own protocol-any rule: nothing after it is reachable.
    assert_eq!(candidate_names(&set, "10.1.2.3/32"), ["bad"]);
    assert_eq!(candidate_names(&set, "0.0.0.0/0"), ["world"]);
}

#[test]
fn most_specific_rule_of_a_prefix_wins() {
    let set = build(&[
        limit("any", "10.0.0.0/8", 1000),
        proto(limit("udp", "10.0.0.0/8", 100), Protocol::Udp, None),
        proto(limit("dns", "10.0.0.0/8", 10), Protocol::Udp, Some(53)),
        proto(limit("ssh", "10.0.0.0/8", 1), Protocol::Tcp, Some(22)),
    ]);
    assert_eq!(
        candidate_names(&set, "10.0.0.0/8"),
        ["ssh", "dns", "udp", "any"]
    );
    assert_eq!(name_of(&set, "10.0.0.1", UDP, Some(53)), Some("dns"));
    assert_eq!(name_of(&set, "10.0.0.1", UDP, Some(54)), Some("udp"));
    assert_eq!(name_of(&set, "10.0.0.1", UDP, None), Some("udp"));
    assert_eq!(name_of(&set, "10.0.0.1", TCP, Some(22)), Some("ssh"));
    assert_eq!(name_of(&set, "10.0.0.1", TCP, Some(23)), Some("any"));
    // A port-specific rule needs the packet's port: a fragment without ports falls through.
    assert_eq!(name_of(&set, "10.0.0.1", TCP, None), Some("any"));
}

#[test]
fn falls_back_to_shorter_prefix() {
    let set = build(&[
        limit("default", "0.0.0.0/0", 1000),
        proto(
            limit("resolver-dns", "192.0.2.53/32", 10),
            Protocol::Udp,
            Some(53),
        ),
    ]);
    assert_eq!(
        candidate_names(&set, "192.0.2.53/32"),
        ["resolver-dns", "default"]
    );
    assert_eq!(
        name_of(&set, "192.0.2.53", UDP, Some(53)),
        Some("resolver-dns")
    );
    assert_eq!(name_of(&set, "192.0.2.53", TCP, Some(53)), Some("default"));
    assert_eq!(name_of(&set, "192.0.2.54", UDP, Some(53)), Some("default"));
}

#[test]
fn shadowed_inherited_rules_are_dropped() {
    let set = build(&[
        proto(
            limit("wide-dns", "10.0.0.0/8", 100),
            Protocol::Udp,
            Some(53),
        ),
        proto(
            limit("wide-tcp80", "10.0.0.0/8", 100),
            Protocol::Tcp,
            Some(80),
        ),
        proto(limit("wide-icmp", "10.0.0.0/8", 100), Protocol::Icmp, None),
        proto(
            limit("narrow-dns", "10.1.0.0/16", 5),
            Protocol::Udp,
            Some(53),
        ),
        proto(limit("narrow-tcp", "10.1.0.0/16", 5), Protocol::Tcp, None),
        limit("host", "10.1.0.7/32", 1),
    ]);
    // wide-dns is shadowed by narrow-dns (same protocol and port); wide-tcp80 by narrow-tcp
    // (which covers every TCP port).
    assert_eq!(
        candidate_names(&set, "10.1.0.0/16"),
        ["narrow-dns", "narrow-tcp", "wide-icmp"]
    );
    assert_eq!(candidate_names(&set, "10.1.0.7/32"), ["host"]);
    assert_eq!(name_of(&set, "10.1.2.3", UDP, Some(53)), Some("narrow-dns"));
    assert_eq!(name_of(&set, "10.1.2.3", TCP, Some(80)), Some("narrow-tcp"));
    assert_eq!(name_of(&set, "10.1.2.3", ICMP, None), Some("wide-icmp"));
    assert_eq!(name_of(&set, "10.1.2.3", UDP, Some(54)), None);
    assert_eq!(name_of(&set, "10.2.0.0", TCP, Some(80)), Some("wide-tcp80"));
    assert_eq!(name_of(&set, "10.1.0.7", UDP, Some(53)), Some("host"));
}

#[test]
fn ipv6_rules() {
    let set = build(&[
        limit("v6-default", "::/0", 1000),
        RuleConfig {
            per: Per::Prefix(64),
            ..limit("v6-net", "2001:db8::/32", 100)
        },
        proto(limit("v6-ping", "2001:db8:1::/48", 1), Protocol::Icmp, None),
        limit("v4-default", "0.0.0.0/0", 10),
    ]);
    assert_eq!(
        name_of(&set, "2001:db8:1::5", ICMPV6, None),
        Some("v6-ping")
    );
    assert_eq!(
        name_of(&set, "2001:db8:1::5", TCP, Some(443)),
        Some("v6-net")
    );
    assert_eq!(name_of(&set, "2001:db8:2::5", ICMPV6, None), Some("v6-net"));
    assert_eq!(
        name_of(&set, "2001:db9::1", UDP, Some(53)),
        Some("v6-default")
    );
    // Families do not mix: IPv4 packets never see ::/0, and IPv4-mapped sources are IPv6.
    assert_eq!(
        name_of(&set, "203.0.113.1", TCP, Some(80)),
        Some("v4-default")
    );
    assert_eq!(
        name_of(&set, "::ffff:203.0.113.1", TCP, Some(80)),
        Some("v6-default")
    );
    let v6net = set.by_name("v6-net").unwrap();
    assert_eq!(v6net.rule.src_mask, [u32::MAX, u32::MAX, 0, 0]);
}

#[test]
fn no_match() {
    assert!(build(&[])
        .classify(ip("10.0.0.1"), TCP, Some(80), 0)
        .is_none());
    assert!(build(&[]).prefixes.is_empty());
    let set = build(&[
        limit("corp", "10.0.0.0/8", 1),
        proto(limit("v6dns", "::/0", 1), Protocol::Udp, Some(53)),
    ]);
    assert_eq!(name_of(&set, "11.0.0.1", TCP, Some(80)), None);
    assert_eq!(name_of(&set, "2001:db8::1", TCP, Some(53)), None);
    assert!(set.lookup(ip("11.0.0.1")).is_none());
}

#[test]
fn same_match_twice_is_an_error() {
    let mut b = proto(
        with_action("b", "10.0.0.0/8", Action::Deny),
        Protocol::Tcp,
        Some(80),
    );
    b.line = 12;
    let a = RuleConfig {
        line: 3,
        ..proto(limit("a", "10.0.0.0/8", 5), Protocol::Tcp, Some(80))
    };
    let msg = compile(&[a, b], &RuleIds::new()).unwrap_err().to_string();
    assert!(
        msg.contains("\"a\" (line 3)")
            && msg.contains("\"b\" (line 12)")
            && msg.contains("10.0.0.0/8"),
        "{msg}"
    );
    let dup = compile(
        &[limit("a", "10.0.0.0/8", 1), limit("a", "11.0.0.0/8", 1)],
        &RuleIds::new(),
    )
    .unwrap_err();
    assert!(matches!(dup, CompileError::DuplicateName { .. }), "{dup}");
    let first = RuleConfig {
        line: 3,
        ..limit("a", "10.0.0.0/8", 1)
    };
    let second = RuleConfig {
        line: 9,
        ..limit("a", "11.0.0.0/8", 1)
    };
    let msg = compile(&[first, second], &RuleIds::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        msg,
        "rule \"a\" (line 9): duplicate name (first used at line 3)"
    );
}

#[test]
fn invalid_rules_are_rejected() {
    let bad = RuleConfig {
        line: 7,
        ..proto(limit("bad", "10.0.0.0/8", 1), Protocol::Any, Some(53))
    };
    let msg = compile(&[bad], &RuleIds::new()).unwrap_err().to_string();
    assert!(
        msg.starts_with("rule \"bad\" (line 7): field `dst_port`"),
        "{msg}"
    );
    let host_bits = limit("h", "10.0.0.1/8", 1);
    assert!(compile(&[host_bits], &RuleIds::new()).is_err());
}

#[test]
fn too_many_candidates() {
    let mut rules = vec![limit("all", "0.0.0.0/0", 1)];
    for port in 1..=4 {
        rules.push(proto(
            limit(&format!("wide{port}"), "10.0.0.0/8", 1),
            Protocol::Tcp,
            Some(port),
        ));
        rules.push(proto(
            limit(&format!("narrow{port}"), "10.1.0.0/16", 1),
            Protocol::Udp,
            Some(port),
        ));
    }
    // 10.1.0.0/16 lists 4 + 4 + 1 = 9 rules.
    let err = compile(&rules, &RuleIds::new()).unwrap_err();
    let CompileError::TooManyCandidates {
        prefix,
        rules: involved,
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(*prefix, net("10.1.0.0/16"));
    assert_eq!(involved.len(), 9);
    assert!(
        err.to_string().contains("\"narrow1\"") && err.to_string().contains("\"all\""),
        "{err}"
    );
    rules.pop();
    assert_eq!(build(&rules).prefixes.len(), 3);
}

#[test]
fn too_many_rules() {
    let rules: Vec<RuleConfig> = (0..=MAX_RULES)
        .map(|i| {
            limit(
                &format!("r{i}"),
                &format!("10.{}.{}.0/24", i >> 8, i & 255),
                1,
            )
        })
        .collect();
    assert!(matches!(
        compile(&rules, &RuleIds::new()),
        Err(CompileError::TooManyRules { .. })
    ));
}

#[test]
fn too_many_prefixes() {
    let rules = vec![with_action("deny-list", "0.0.0.0/32", Action::Deny)];
    let count = MAX_PREFIXES as usize / 2 + 1;
    let sources: Vec<(IpNet, usize)> = (0..count as u32)
        .map(|i| (IpNet::V4(Ipv4Net::new(Ipv4Addr::from(i), 32).unwrap()), 0))
        .collect();
    let compiled = assign_ids(&rules, &RuleIds::new()).unwrap();
    let err = build_prefixes(&rules, &compiled, &sources).unwrap_err();
    assert_eq!(err, CompileError::TooManyPrefixes { count });
    assert!(build_prefixes(&rules, &compiled, &sources[1..]).is_ok());
}

#[test]
fn one_rule_many_prefixes() {
    let set = build(&[
        limit("default", "0.0.0.0/0", 1000),
        // Nested prefixes of one rule: the inner one lists the rule once.
        multi(
            "blocklist",
            &["10.0.0.0/8", "10.1.0.0/16", "192.0.2.7/32", "2001:db8::/32"],
            Action::Deny,
        ),
        with_action("office", "10.1.2.0/24", Action::Allow),
    ]);
    let block = set.by_name("blocklist").unwrap();
    assert_eq!(block.sources.len(), 4);
    // One rule id for every prefix.
    for p in ["10.0.0.0/8", "10.1.0.0/16", "192.0.2.7/32", "2001:db8::/32"] {
        assert_eq!(candidate_names(&set, p), ["blocklist"]);
    }
    assert_eq!(candidate_names(&set, "10.1.2.0/24"), ["office"]);
    assert_eq!(set.prefixes.len(), 6);
    assert_eq!(
        name_of(&set, "10.200.0.1", TCP, Some(80)),
        Some("blocklist")
    );
    assert_eq!(name_of(&set, "10.1.9.9", UDP, None), Some("blocklist"));
    assert_eq!(name_of(&set, "10.1.2.9", UDP, None), Some("office"));
    assert_eq!(name_of(&set, "192.0.2.7", ICMP, None), Some("blocklist"));
    assert_eq!(name_of(&set, "192.0.2.8", ICMP, None), Some("default"));
    assert_eq!(
        name_of(&set, "2001:db8::1", ICMPV6, None),
        Some("blocklist")
    );
    assert_eq!(name_of(&set, "2001:db9::1", ICMPV6, None), None);

    // Listed twice in one rule: merged.
    let dup = build(&[multi("d", &["10.0.0.0/8", "10.0.0.0/8"], Action::Deny)]);
    assert_eq!(dup.prefixes.len(), 1);
    assert_eq!(candidate_names(&dup, "10.0.0.0/8"), ["d"]);
}

#[test]
fn two_rules_listing_one_prefix() {
    let tcp = proto(
        multi("tcp", &["10.0.0.0/8", "11.0.0.0/8"], Action::Limit),
        Protocol::Tcp,
        None,
    );
    let udp = proto(
        multi("udp", &["12.0.0.0/8", "11.0.0.0/8"], Action::Deny),
        Protocol::Udp,
        Some(53),
    );
    let set = build(&[tcp.clone(), udp.clone()]);
    assert_eq!(candidate_names(&set, "11.0.0.0/8"), ["udp", "tcp"]);
    assert_eq!(name_of(&set, "11.1.1.1", UDP, Some(53)), Some("udp"));
    assert_eq!(name_of(&set, "11.1.1.1", TCP, Some(53)), Some("tcp"));
    assert_eq!(name_of(&set, "10.1.1.1", UDP, Some(53)), None);
    assert_eq!(name_of(&set, "12.1.1.1", UDP, Some(53)), Some("udp"));

    // The same protocol and port: the shared prefix is a conflict, named.
    let mut clash = proto(udp, Protocol::Tcp, None);
    clash.line = 30;
    let tcp = RuleConfig { line: 10, ..tcp };
    let err = compile(&[tcp, clash], &RuleIds::new()).unwrap_err();
    assert_eq!(
        err,
        CompileError::Conflict {
            first: "tcp".into(),
            first_line: 10,
            second: "udp".into(),
            second_line: 30,
            prefix: net("11.0.0.0/8"),
            protocol: Protocol::Tcp,
            dst_port: None,
            tcp_flags: None,
        }
    );
    assert!(
        err.to_string()
            .contains("rules \"tcp\" (line 10) and \"udp\" (line 30) both match source 11.0.0.0/8"),
        "{err}"
    );
}

#[test]
fn candidates_count_rules_not_prefixes() {
    // One rule listing a prefix and prefixes inside it is one candidate wherever it applies.
    let mut rules = vec![multi(
        "wide",
        &["10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32"],
        Action::Limit,
    )];
    for port in 1..=7 {
        rules.push(proto(
            multi(
                &format!("p{port}"),
                &["10.0.0.0/8", "10.1.2.0/24"],
                Action::Deny,
            ),
            Protocol::Tcp,
            Some(port),
        ));
    }
    let set = build(&rules);
    assert_eq!(candidate_names(&set, "10.1.2.3/32"), ["wide"]);
    assert_eq!(candidate_names(&set, "10.1.2.0/24").len(), 8);
    // 10.1.0.0/16 lists only "wide": its own protocol-any entry covers all it would inherit.
    assert_eq!(candidate_names(&set, "10.1.0.0/16"), ["wide"]);
    assert_eq!(name_of(&set, "10.1.9.9", TCP, Some(3)), Some("wide"));
    assert_eq!(name_of(&set, "10.9.9.9", TCP, Some(3)), Some("p3"));
    assert_eq!(name_of(&set, "10.1.2.9", TCP, Some(3)), Some("p3"));

    // An eighth port rule makes 10.0.0.0/8 and 10.1.2.0/24 list nine.
    rules.push(proto(
        multi("p8", &["10.1.2.0/24"], Action::Deny),
        Protocol::Tcp,
        Some(8),
    ));
    let err = compile(&rules, &RuleIds::new()).unwrap_err();
    assert!(
        matches!(&err, CompileError::TooManyCandidates { prefix, rules } if *prefix == net("10.1.2.0/24") && rules.len() == 9),
        "{err}"
    );
}

#[test]
fn mixed_families() {
    let both = RuleConfig {
        per: Per::Source,
        ..multi("both", &["10.0.0.0/8", "2001:db8::/32"], Action::Limit)
    };
    let rec = rule_record(&both);
    // IPv4 keys are zero past the first word, so masking all four words keeps them.
    assert_eq!(rec.src_mask, [u32::MAX; 4]);
    let shared = RuleConfig {
        per: Per::Rule,
        ..both.clone()
    };
    assert_eq!(rule_record(&shared).src_mask, [0; 4]);
    let set = build(std::slice::from_ref(&both));
    assert_eq!(name_of(&set, "10.0.0.1", UDP, None), Some("both"));
    assert_eq!(name_of(&set, "2001:db8::1", UDP, None), Some("both"));
    let v4_only = multi("v4", &["10.0.0.0/8", "11.0.0.0/8"], Action::Limit);
    assert_eq!(rule_record(&v4_only).src_mask, [u32::MAX, 0, 0, 0]);

    // "/24" and "icmp" are family specific.
    let per24 = RuleConfig {
        per: Per::Prefix(24),
        line: 4,
        ..both.clone()
    };
    let err = compile(&[per24], &RuleIds::new()).unwrap_err().to_string();
    assert!(
        err.starts_with("rule \"both\" (line 4): field `per`") && err.contains("mix IPv4 and IPv6"),
        "{err}"
    );
    let icmp = proto(both, Protocol::Icmp, None);
    let err = compile(&[icmp], &RuleIds::new()).unwrap_err().to_string();
    assert!(
        err.contains("field `protocol`") && err.contains("one rule per family"),
        "{err}"
    );
    let icmp6 = proto(
        multi("v6", &["2001:db8::/32", "2001:db9::/32"], Action::Deny),
        Protocol::Icmp,
        None,
    );
    assert_eq!(rule_record(&icmp6).protocol, ICMPV6);
}

#[test]
fn rule_prefix_bounds() {
    let too_many: Vec<IpNet> = (0..=crate::config::MAX_RULE_PREFIXES as u32)
        .map(|i| IpNet::V4(Ipv4Net::new(Ipv4Addr::from(i << 8), 24).unwrap()))
        .collect();
    let rule = RuleConfig {
        action: Action::Deny,
        ..RuleConfig::with_sources("big", too_many)
    };
    let err = compile(std::slice::from_ref(&rule), &RuleIds::new()).unwrap_err();
    assert!(err.to_string().contains("at most 250000"), "{err}");
    // 250 000 in one rule and 12 145 in another: one more than half the trie.
    let mut first = rule;
    first.sources.truncate(crate::config::MAX_RULE_PREFIXES);
    let second = RuleConfig {
        action: Action::Deny,
        ..RuleConfig::with_sources(
            "second",
            (0..(MAX_PREFIXES as usize / 2 - crate::config::MAX_RULE_PREFIXES + 1) as u32)
                .map(|i| IpNet::V4(Ipv4Net::new(Ipv4Addr::from(i), 32).unwrap()))
                .collect(),
        )
    };
    let err = compile(&[first.clone(), second.clone()], &RuleIds::new()).unwrap_err();
    assert_eq!(
        err,
        CompileError::TooManyPrefixes {
            count: MAX_PREFIXES as usize / 2 + 1
        }
    );
    assert!(err.to_string().contains("at most 262144"), "{err}");
    let mut fits = second;
    fits.sources.pop();
    assert_eq!(
        build(&[first, fits]).prefixes.len(),
        MAX_PREFIXES as usize / 2
    );
}

/// What the program does with a source's packets that hide their protocol and port: the first
/// rule where no rule of the prefix looks at them (inherited ones included), dropped where one
/// does, passed where no prefix holds the source.
#[test]
fn packets_without_l4_fall_to_the_first_rule_only_where_no_rule_needs_l4() {
    let set = build(&[
        with_action("any16", "198.18.0.0/16", Action::Allow),
        proto(
            with_action("dns24", "198.18.1.0/24", Action::Deny),
            Protocol::Udp,
            Some(53),
        ),
        limit("any25", "198.18.1.128/25", 10),
        proto(limit("tcp-v6", "2001:db8::/32", 10), Protocol::Tcp, None),
    ]);
    let name = |w: WithoutL4<'_>| match w {
        WithoutL4::Rule(r) => r.name.clone(),
        WithoutL4::NoRule => "none".into(),
        WithoutL4::Dependent => "dropped".into(),
    };
    assert_eq!(name(set.classify_without_l4(ip("198.18.0.1"))), "any16");
    // The /24 has a port rule.
    assert_eq!(name(set.classify_without_l4(ip("198.18.1.1"))), "dropped");
    // The /25's own rule takes every packet of it (longest prefix), so the /24's port rule can
    // never apply there.
    assert_eq!(name(set.classify_without_l4(ip("198.18.1.200"))), "any25");
    // A protocol rule is enough.
    assert_eq!(name(set.classify_without_l4(ip("2001:db8::1"))), "dropped");
    assert_eq!(name(set.classify_without_l4(ip("198.19.0.1"))), "none");
    // An IPv4 fragment names its protocol: the /24's UDP port rule could only take UDP.
    assert_eq!(
        name(set.classify_without_port(ip("198.18.1.1"), 17)),
        "dropped"
    );
    assert_eq!(
        name(set.classify_without_port(ip("198.18.1.1"), 6)),
        "any16"
    );
    assert_eq!(
        name(set.classify_without_port(ip("198.18.1.200"), 17)),
        "any25"
    );
    assert_eq!(
        name(set.classify_without_port(ip("198.19.0.1"), 17)),
        "none"
    );
}
