//! Rules on TCP flags (SYN rules): their record, their rank beside rules without flags, what they
//! inherit and shadow, and the conflicts refused.

use super::*;

fn syn(mut r: RuleConfig) -> RuleConfig {
    r.tcp_flags = Some(TcpFlags::Syn);
    r
}

#[test]
fn syn_rule_record() {
    let rec = rule_record(&syn(proto(
        limit("syn", "0.0.0.0/0", 10),
        Protocol::Tcp,
        None,
    )));
    assert_eq!(
        (rec.protocol, rec.tcp_mask, rec.tcp_flags),
        (TCP, 0x12, 0x02)
    );
    let rec = rule_record(&proto(limit("tcp", "0.0.0.0/0", 10), Protocol::Tcp, None));
    assert_eq!((rec.tcp_mask, rec.tcp_flags), (0, 0));
}

#[test]
fn syn_rule_beats_the_same_prefixs_rule_without_flags() {
    let set = build(&[
        limit("any", "10.0.0.0/8", 1000),
        proto(limit("tcp", "10.0.0.0/8", 500), Protocol::Tcp, None),
        syn(proto(limit("syn", "10.0.0.0/8", 10), Protocol::Tcp, None)),
        proto(limit("web", "10.0.0.0/8", 100), Protocol::Tcp, Some(80)),
        syn(proto(
            limit("web-syn", "10.0.0.0/8", 5),
            Protocol::Tcp,
            Some(80),
        )),
    ]);
    // protocol+port+flags, protocol+port, protocol+flags, protocol, any.
    assert_eq!(
        candidate_names(&set, "10.0.0.0/8"),
        ["web-syn", "web", "syn", "tcp", "any"]
    );
    let at = |port: u16, flags: u8| {
        set.classify(ip("10.1.2.3"), TCP, Some(port), flags)
            .map(|r| r.name.as_str())
    };
    assert_eq!(at(22, 0x02), Some("syn"));
    assert_eq!(at(22, 0x02 | 0x08), Some("syn"), "SYN+PSH is still a SYN");
    assert_eq!(at(22, 0x12), Some("tcp"), "SYN-ACK is not");
    assert_eq!(at(22, 0x10), Some("tcp"));
    assert_eq!(at(22, 0), Some("tcp"));
    assert_eq!(at(80, 0x02), Some("web-syn"));
    assert_eq!(at(80, 0x12), Some("web"));
    // Without its header (a cut packet), a TCP packet has no flags.
    assert_eq!(name_of(&set, "10.1.2.3", TCP, None), Some("tcp"));
    assert_eq!(name_of(&set, "10.1.2.3", UDP, Some(80)), Some("any"));
}

#[test]
fn port_rule_outranks_a_syn_rule_without_the_port() {
    // A SYN cannot walk past a port's deny rule by being a SYN.
    let set = build(&[
        syn(proto(limit("syn", "0.0.0.0/0", 10), Protocol::Tcp, None)),
        proto(
            with_action("no-ssh", "0.0.0.0/0", Action::Deny),
            Protocol::Tcp,
            Some(22),
        ),
    ]);
    assert_eq!(candidate_names(&set, "0.0.0.0/0"), ["no-ssh", "syn"]);
    let at = |port: u16, flags: u8| {
        set.classify(ip("192.0.2.1"), TCP, Some(port), flags)
            .map(|r| r.name.as_str())
    };
    assert_eq!(at(22, 0x02), Some("no-ssh"));
    assert_eq!(at(80, 0x02), Some("syn"));
    assert_eq!(at(80, 0x10), None);
}

#[test]
fn syn_rules_inherit_and_shadow_by_flags() {
    let set = build(&[
        syn(proto(limit("syn", "0.0.0.0/0", 10), Protocol::Tcp, None)),
        limit("default", "0.0.0.0/0", 1000),
        // A longer prefix's TCP rule covers the SYN rule: SYNs from it are its own.
        proto(limit("lab-tcp", "10.0.0.0/8", 100), Protocol::Tcp, None),
        // A longer prefix's UDP rule does not: its SYNs still meet the SYN rule.
        proto(limit("lab-udp", "192.168.0.0/16", 100), Protocol::Udp, None),
        // A longer prefix's own SYN rule covers the inherited one.
        syn(proto(
            limit("lab-syn", "172.16.0.0/12", 1),
            Protocol::Tcp,
            None,
        )),
    ]);
    assert_eq!(candidate_names(&set, "0.0.0.0/0"), ["syn", "default"]);
    assert_eq!(candidate_names(&set, "10.0.0.0/8"), ["lab-tcp", "default"]);
    assert_eq!(
        candidate_names(&set, "192.168.0.0/16"),
        ["lab-udp", "syn", "default"]
    );
    assert_eq!(
        candidate_names(&set, "172.16.0.0/12"),
        ["lab-syn", "default"]
    );
    let at = |src: &str, flags: u8| {
        set.classify(ip(src), TCP, Some(443), flags)
            .map(|r| r.name.as_str())
    };
    assert_eq!(at("10.1.1.1", 0x02), Some("lab-tcp"));
    assert_eq!(at("192.168.1.1", 0x02), Some("syn"));
    assert_eq!(at("192.168.1.1", 0x10), Some("default"));
    assert_eq!(at("172.16.1.1", 0x02), Some("lab-syn"));
    assert_eq!(at("203.0.113.1", 0x02), Some("syn"));
    assert_eq!(at("203.0.113.1", 0x12), Some("default"));
}

#[test]
fn two_syn_rules_on_one_prefix_conflict_but_a_syn_rule_beside_a_tcp_rule_does_not() {
    let tcp = proto(limit("tcp", "10.0.0.0/8", 100), Protocol::Tcp, None);
    let a = syn(proto(limit("a", "10.0.0.0/8", 10), Protocol::Tcp, None));
    let b = RuleConfig {
        line: 7,
        ..syn(proto(limit("b", "10.0.0.0/8", 10), Protocol::Tcp, None))
    };
    assert!(compile(&[tcp, a.clone()], &RuleIds::new()).is_ok());
    let err = compile(&[a, b], &RuleIds::new()).unwrap_err();
    assert!(
        matches!(
            err,
            CompileError::Conflict {
                tcp_flags: Some(TcpFlags::Syn),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("tcp_flags syn"), "{err}");
}

#[test]
fn syn_rule_needs_protocol_tcp() {
    let bad = syn(proto(limit("bad", "10.0.0.0/8", 10), Protocol::Udp, None));
    let err = compile(&[bad], &RuleIds::new()).unwrap_err();
    assert!(
        err.to_string().contains("tcp_flags") && err.to_string().contains("protocol tcp"),
        "{err}"
    );
    let any = syn(limit("any", "10.0.0.0/8", 10));
    assert!(compile(&[any], &RuleIds::new()).is_err());
}

#[test]
fn flag_rules_make_cut_packets_dependent() {
    let set = build(&[syn(proto(
        limit("syn", "0.0.0.0/0", 10),
        Protocol::Tcp,
        None,
    ))]);
    assert!(matches!(
        set.classify_without_l4(ip("192.0.2.1")),
        WithoutL4::Dependent
    ));
}
