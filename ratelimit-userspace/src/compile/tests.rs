use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn limit(name: &str, source: &str, rate: u64) -> RuleConfig {
    RuleConfig {
        rate: Some(rate),
        burst: Some(rate),
        ..RuleConfig::new(name, net(source))
    }
}

fn with_action(name: &str, source: &str, action: Action) -> RuleConfig {
    RuleConfig {
        action,
        ..RuleConfig::new(name, net(source))
    }
}

fn proto(mut r: RuleConfig, protocol: Protocol, port: Option<u16>) -> RuleConfig {
    r.protocol = protocol;
    r.dst_port = port;
    r
}

fn build(rules: &[RuleConfig]) -> CompiledRuleSet {
    compile(rules, &RuleIds::new()).unwrap_or_else(|e| panic!("compile failed: {e}"))
}

fn name_of<'a>(
    set: &'a CompiledRuleSet,
    src: &str,
    protocol: u8,
    port: Option<u16>,
) -> Option<&'a str> {
    set.classify(ip(src), protocol, port, 0)
        .map(|r| r.name.as_str())
}

fn candidate_names(set: &CompiledRuleSet, prefix: &str) -> Vec<String> {
    let p = set
        .prefixes
        .iter()
        .find(|p| p.net() == net(prefix))
        .expect("prefix compiled");
    p.candidates()
        .iter()
        .map(|&id| set.rule(id).unwrap().name.clone())
        .collect()
}

#[test]
fn packet_limit_record() {
    let r = RuleConfig {
        burst: Some(20),
        ..limit("a", "10.0.0.0/8", 3)
    };
    let rec = rule_record(&r);
    assert_eq!(
        (rec.action, rec.protocol, rec.dst_port),
        (action::LIMIT, 0, 0)
    );
    // 1e9 / 3 rounded up: 3 packets a second at most, never 3.000000003.
    assert_eq!(rec.pkt_interval_ns, 333_333_334);
    for rate in [3u64, 7, 600_000, 30_000_000, 999_999_999, 1_000_000_000] {
        let i = rule_record(&RuleConfig {
            burst: Some(1),
            ..limit("a", "10.0.0.0/8", rate)
        })
        .pkt_interval_ns;
        assert!(i * rate >= 1_000_000_000, "rate {rate}: interval {i} ns");
        assert!(
            (i - 1) * rate < 1_000_000_000,
            "rate {rate}: interval {i} ns"
        );
    }
    assert_eq!(rec.pkt_tolerance_ns, 20 * 333_333_334);
    assert_eq!((rec.byte_interval_fp, rec.byte_tolerance_ns), (0, 0));
    // A burst of 20 at 3/s: the lag refills a packet (rounded up), and 20 is not 100 of them;
    // 19 packets' tolerance beyond one is more than the lag, so its windows hold on the coarse
    // clock (see windows_hold_where_a_sources_own_bucket_keeps_the_tokens).
    assert_eq!(
        rec.flags,
        rule_flags::PKT_LIMIT
            | rule_flags::COARSE_CLOCK
            | rule_flags::HOLD_WINDOW
            | rule_flags::FIRST_FREE
    );
    assert_eq!(rec.src_mask, [u32::MAX, 0, 0, 0]);
}

/// The coarse clock alone from a tolerance of 100 lag allowances, in the rule's flags and every
/// limit's; one limit under it keeps the whole rule off it.
/// A limit's keys pass their first packet without a bucket (`FIRST_FREE`) where it limits
/// packets alone and is not cluster-scoped, and is the rule's own: an extra limit's never do.
#[test]
fn first_packets_free_for_local_packet_limits_alone() {
    let free = |flags: u32| flags & rule_flags::FIRST_FREE != 0;
    let mut r = limit("a", "10.0.0.0/8", 1000);
    r.limits.push(crate::config::LimitConfig {
        per: crate::config::Per::Rule,
        rate: Some(1000),
        burst: Some(10),
        bytes_rate: Some(1_000_000),
        bytes_burst: Some(100_000),
        scope: crate::config::Scope::Local,
        line: 0,
    });
    r.limits.push(crate::config::LimitConfig {
        per: crate::config::Per::Source,
        rate: Some(100),
        burst: Some(10),
        bytes_rate: None,
        bytes_burst: None,
        scope: crate::config::Scope::Local,
        line: 0,
    });
    let rec = rule_record(&r);
    assert!(free(rec.flags), "a packet limit");
    assert!(!free(rec.extra[0].flags), "a packet and byte limit");
    assert!(!free(rec.extra[1].flags), "an extra packet limit");
    let cluster = rule_record(&RuleConfig {
        scope: crate::config::Scope::Cluster,
        ..limit("c", "10.0.0.0/8", 1000)
    });
    assert!(!free(cluster.flags), "a cluster-scoped limit");
}

#[test]
fn coarse_only_from_a_hundred_lags() {
    let lag = super::coarse_lag_ns();
    // rate 1000: 1 ms a packet; the lag refills `ceil(lag / 1 ms)` packets, 100 times that.
    let at = 100 * lag.div_ceil(1_000_000);
    let rule = |burst: u64, extra_burst: Option<u64>| {
        let mut r = RuleConfig {
            burst: Some(burst),
            ..limit("a", "10.0.0.0/8", 1000)
        };
        if let Some(b) = extra_burst {
            r.limits.push(crate::config::LimitConfig {
                per: crate::config::Per::Rule,
                rate: Some(1000),
                burst: Some(b),
                bytes_rate: None,
                bytes_burst: None,
                scope: crate::config::Scope::Local,
                line: 0,
            });
        }
        rule_record(&r)
    };
    let only = |rec: &ratelimit_common::Rule| rec.flags & rule_flags::COARSE_ONLY != 0;
    assert!(only(&rule(at, None)), "{at} ms of tolerance, lag {lag} ns");
    assert!(!only(&rule(at - 1, None)), "{} ms", at - 1);
    let both = rule(at, Some(at));
    assert!(only(&both));
    assert_ne!(
        both.extra[0].flags & rule_flags::COARSE_ONLY,
        0,
        "the extra limit's flags"
    );
    let one_short = rule(at, Some(at - 1));
    assert!(!only(&one_short), "an extra limit under 100 lags");
    assert_eq!(one_short.extra[0].flags & rule_flags::COARSE_ONLY, 0);
    assert_ne!(
        one_short.flags & rule_flags::COARSE_CLOCK,
        0,
        "still the coarse clock"
    );
}

/// A drop window holds on the coarse clock (`HOLD_WINDOW`) only where holding it up to the lag
/// loses its source nothing: every limit a source's own bucket, none cluster-scoped, each
/// tolerance at least the lag plus its largest cost (one packet; a 64 KiB frame in bytes). A
/// shared bucket (`per = "/24"`, `per = "rule"`) keeps the precise clock at a source's window's
/// end, where a held source would miss the refill the others of its group take meanwhile; a
/// per-rule limit's own window (the gate's, `HOLD_GATE`), which holds every source of the rule
/// alike, holds under the same condition on that limit.
#[test]
fn windows_hold_where_a_sources_own_bucket_keeps_the_tokens() {
    use crate::config::{LimitConfig, Per, Scope};
    let lag = super::coarse_lag_ns();
    let holds = |r: &RuleConfig| rule_record(r).flags & rule_flags::HOLD_WINDOW != 0;
    // rate 100: 10 ms a packet (so that both sides of the line are on the coarse clock, 20 ms
    // of tolerance or more, at any tick). The tolerance beyond one packet must cover the lag.
    let n = lag.div_ceil(10_000_000);
    let at = |burst: u64| RuleConfig {
        burst: Some(burst),
        ..limit("a", "10.0.0.0/8", 100)
    };
    assert!(holds(&at(n + 1)), "burst {}, lag {lag} ns", n + 1);
    assert!(!holds(&at(n)), "burst {n}, lag {lag} ns");
    // `burst = 1`: nothing beyond the packet itself, so a held window would lose a token.
    assert!(!holds(&RuleConfig {
        burst: Some(1),
        ..limit("a", "10.0.0.0/8", 10)
    }));
    // Shared buckets, cluster scope.
    let big = at(10 * n + 1);
    assert!(holds(&big));
    for (per, scope, what) in [
        (Per::Prefix(24), Scope::Local, "per /24"),
        (Per::Rule, Scope::Local, "per rule"),
        (Per::Source, Scope::Cluster, "cluster-scoped"),
    ] {
        assert!(
            !holds(&RuleConfig {
                per,
                scope,
                ..big.clone()
            }),
            "{what}"
        );
        let mut layered = big.clone();
        layered.limits.push(LimitConfig {
            per,
            rate: Some(100),
            burst: Some(10 * n + 1),
            bytes_rate: None,
            bytes_burst: None,
            scope,
            line: 0,
        });
        assert!(!holds(&layered), "a second limit {what}");
    }
    // A per-rule limit (the gate) holds its own window under the same condition, as its one
    // bucket keeps the tokens for every source of the rule alike; not cluster-scoped.
    let gate = |r: &RuleConfig| rule_record(r).flags & rule_flags::HOLD_GATE != 0;
    let per_rule = |burst: u64, scope: Scope| RuleConfig {
        per: Per::Rule,
        scope,
        ..at(burst)
    };
    assert!(gate(&per_rule(n + 1, Scope::Local)), "per rule");
    assert!(
        !holds(&per_rule(n + 1, Scope::Local)),
        "not a source's window"
    );
    assert!(!gate(&per_rule(n, Scope::Local)), "per rule, burst {n}");
    assert!(!gate(&per_rule(n + 1, Scope::Cluster)), "per rule, cluster");
    let mut layered = big.clone();
    layered.limits.push(LimitConfig {
        per: Per::Rule,
        rate: Some(100),
        burst: Some(10 * n + 1),
        bytes_rate: None,
        bytes_burst: None,
        scope: Scope::Local,
        line: 0,
    });
    assert!(gate(&layered), "a per-rule limit after a source's");
    assert!(!holds(&layered), "a shared limit in the rule");
    assert!(!gate(&big), "no per-rule limit, no gate");
    // Bytes: a 64 KiB frame's cost beyond the lag. 1 MB/s: 65.536 ms for 64 KiB.
    let bytes = |burst: u64| RuleConfig {
        bytes_rate: Some(1_000_000),
        bytes_burst: Some(burst),
        ..RuleConfig::new("b", net("10.0.0.0/8"))
    };
    let need = (lag + 65_536_000).div_ceil(1_000);
    assert!(holds(&bytes(need)), "bytes burst {need}");
    assert!(!holds(&bytes(need - 100)), "bytes burst {}", need - 100);
}

/// New buckets are made on the coarse clock (`BORN_COARSE`), settled at their next charge, in
/// each limit where the one packet that may cost is at most 1% of its burst (100 packets or
/// more): a packet limit alone, on the coarse clock but not on it alone, neither cluster-scoped
/// nor per rule; per limit, so a rule's second limit has its own flag.
#[test]
fn new_buckets_are_born_coarse_where_one_packet_is_a_hundredth_of_the_burst() {
    use crate::config::{LimitConfig, Per, Scope};
    let born = |r: &RuleConfig, k: usize| {
        let l = rule_record(r).limit(k).unwrap();
        let set = l.flags & rule_flags::BORN_COARSE != 0;
        // The program reads the flag only beside the others it expects: wherever the agent
        // sets it, all of them are there.
        assert_eq!(
            rule_flags::born_coarse_in_force(l.flags),
            set,
            "limit {k} of {}: flags {:#x}",
            r.name,
            l.flags
        );
        set
    };
    // rate 1,000: 1 ms a packet; 100 ms of tolerance or more is on the coarse clock, and far
    // from the 100 lags (3.2 s at HZ=250) of the coarse clock alone.
    let at = |burst: u64| RuleConfig {
        burst: Some(burst),
        ..limit("a", "10.0.0.0/8", 1_000)
    };
    assert!(born(&at(100), 0), "burst 100");
    assert!(!born(&at(99), 0), "burst 99");
    let r = rule_record(&at(100));
    assert_ne!(r.flags & rule_flags::COARSE_CLOCK, 0);
    assert_eq!(r.flags & rule_flags::COARSE_ONLY, 0);
    assert!(!born(&at(1_000_000), 0), "on the coarse clock alone");
    // Below the coarse clock's 20 ms: precise, whatever the burst.
    assert!(!born(
        &RuleConfig {
            burst: Some(150),
            ..limit("a", "10.0.0.0/8", 1_000_000)
        },
        0
    ));
    for (per, scope, what) in [
        (Per::Prefix(24), Scope::Local, true),
        (Per::Rule, Scope::Local, false),
        (Per::Source, Scope::Cluster, false),
    ] {
        let r = RuleConfig {
            per,
            scope,
            ..at(200)
        };
        assert_eq!(born(&r, 0), what, "{per:?} {scope:?}");
    }
    let bytes = RuleConfig {
        bytes_rate: Some(1_000_000),
        bytes_burst: Some(1_000_000),
        ..at(200)
    };
    assert!(!born(&bytes, 0), "a byte limit too");
    let mut layered = at(200);
    for (per, burst) in [(Per::Prefix(24), 500), (Per::Source, 50)] {
        layered.limits.push(LimitConfig {
            per,
            rate: Some(1_000),
            burst: Some(burst),
            bytes_rate: None,
            bytes_burst: None,
            scope: Scope::Local,
            line: 0,
        });
    }
    assert!(born(&layered, 0) && born(&layered, 1) && !born(&layered, 2));
}

#[test]
fn byte_limit_record() {
    let r = RuleConfig {
        bytes_rate: Some(1_000_000),
        bytes_burst: Some(1_500_000),
        ..RuleConfig::new("b", net("::/0"))
    };
    let rec = rule_record(&r);
    // COARSE_ONLY too on a kernel of 1,000 ticks a second (see coarse_only_from_a_hundred_lags).
    assert_eq!(
        rec.flags & !rule_flags::COARSE_ONLY,
        rule_flags::BYTE_LIMIT | rule_flags::COARSE_CLOCK | rule_flags::HOLD_WINDOW
    );
    assert_eq!(rec.byte_interval_fp, (1_000_000_000u64 << 16) / 1_000_000);
    // A rate that does not divide it: the interval rounds up (never a byte a second over).
    let odd = rule_record(&RuleConfig {
        bytes_rate: Some(3_000_000),
        ..r.clone()
    });
    assert_eq!(odd.byte_interval_fp, 21_845_334);
    assert!(u128::from(odd.byte_interval_fp) * 3_000_000 >= 1_000_000_000u128 << 16);
    assert_eq!(rec.byte_tolerance_ns, 1_500_000_000);
    assert_eq!(rec.src_mask, [u32::MAX; 4]);
    // One full-size frame costs about 1514 us at 1 MB/s.
    assert_eq!(
        ratelimit_common::byte_cost_ns(1514, rec.byte_interval_fp),
        1_514_000
    );
}

#[test]
fn coarse_clock_needs_every_tolerance_over_20ms() {
    // 100 packets at 10 000/s: 10 ms of tolerance, too short for a 4 ms tick.
    let fine = RuleConfig {
        burst: Some(100),
        ..limit("a", "10.0.0.0/8", 10_000)
    };
    assert_eq!(rule_record(&fine).flags & rule_flags::COARSE_CLOCK, 0);
    let coarse = RuleConfig {
        burst: Some(200),
        ..fine.clone()
    };
    assert_ne!(rule_record(&coarse).flags & rule_flags::COARSE_CLOCK, 0);
    // The byte limit's tolerance is 1514 B at 1 MB/s = 1.5 ms: no coarse clock for the rule.
    let mixed = RuleConfig {
        bytes_rate: Some(1_000_000),
        bytes_burst: Some(1514),
        ..coarse
    };
    let rec = rule_record(&mixed);
    assert_eq!(rec.flags & rule_flags::COARSE_CLOCK, 0);
    assert_eq!(
        rec.flags & (rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT),
        rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT
    );
}

#[test]
fn flags_and_masks() {
    let r = RuleConfig {
        dry_run: true,
        scope: Scope::Cluster,
        per: Per::Prefix(24),
        ..limit("a", "10.0.0.0/8", 5)
    };
    let rec = rule_record(&r);
    assert_ne!(rec.flags & rule_flags::DRY_RUN, 0);
    assert_ne!(rec.flags & rule_flags::CLUSTER, 0);
    assert_eq!(
        rec.src_mask,
        [u32::from_ne_bytes([255, 255, 255, 0]), 0, 0, 0]
    );

    let v6 = RuleConfig {
        per: Per::Prefix(64),
        ..limit("b", "2001:db8::/32", 5)
    };
    assert_eq!(rule_record(&v6).src_mask, [u32::MAX, u32::MAX, 0, 0]);
    let v6 = RuleConfig {
        per: Per::Prefix(68),
        ..v6
    };
    assert_eq!(
        rule_record(&v6).src_mask,
        [u32::MAX, u32::MAX, u32::from_ne_bytes([0xf0, 0, 0, 0]), 0]
    );
    let shared = RuleConfig {
        per: Per::Rule,
        ..limit("c", "10.0.0.0/8", 5)
    };
    assert_eq!(rule_record(&shared).src_mask, [0; 4]);
}

#[test]
fn protocols_per_family() {
    let icmp4 = proto(limit("a", "10.0.0.0/8", 1), Protocol::Icmp, None);
    let icmp6 = proto(limit("b", "::/0", 1), Protocol::Icmp, None);
    let dns = proto(limit("c", "::/0", 1), Protocol::Udp, Some(53));
    assert_eq!(rule_record(&icmp4).protocol, ICMP);
    assert_eq!(rule_record(&icmp6).protocol, ICMPV6);
    assert_eq!(
        (rule_record(&dns).protocol, rule_record(&dns).dst_port),
        (UDP, 53)
    );
    assert_eq!(
        rule_record(&proto(limit("d", "::/0", 1), Protocol::Tcp, None)).protocol,
        TCP
    );
}

#[test]
fn allow_and_deny_records_have_no_limits() {
    for (a, code) in [(Action::Allow, action::ALLOW), (Action::Deny, action::DENY)] {
        let rec = rule_record(&RuleConfig {
            dry_run: true,
            ..with_action("x", "10.0.0.0/8", a)
        });
        assert_eq!(
            rec,
            Rule {
                action: code,
                flags: rule_flags::DRY_RUN,
                ..Rule::default()
            }
        );
    }
}

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
fn ids_are_stable_across_reloads() {
    let mut ids = RuleIds::new();
    let v1 = vec![
        limit("a", "10.0.0.0/8", 1),
        limit("b", "11.0.0.0/8", 1),
        limit("c", "12.0.0.0/8", 1),
    ];
    let set1 = compile(&v1, &ids).unwrap();
    assert_eq!(
        set1.rules
            .iter()
            .map(|r| (r.id, r.fresh))
            .collect::<Vec<_>>(),
        [(0, true), (1, true), (2, true)]
    );
    assert_eq!(ids.commit(&set1).unwrap(), Vec::<u32>::new());

    // "a" unchanged (moving it in the file and a new source do not matter), "b" changed, "c"
    // removed, "d" added.
    let v2 = vec![
        limit("d", "13.0.0.0/8", 1),
        limit("b", "11.0.0.0/8", 2),
        RuleConfig {
            line: 40,
            ..limit("a", "10.0.0.0/9", 1)
        },
    ];
    let set2 = compile(&v2, &ids).unwrap();
    let got: Vec<_> = set2
        .rules
        .iter()
        .map(|r| (r.name.as_str(), r.id, r.fresh))
        .collect();
    // Fresh ids avoid 0..=2, which the active generation uses until the swap.
    assert_eq!(got, [("d", 3, true), ("b", 4, true), ("a", 0, false)]);
    assert_eq!(ids.commit(&set2).unwrap(), [1, 2]);
    assert_eq!(
        (ids.id_of("a"), ids.id_of("b"), ids.id_of("c")),
        (Some(0), Some(4), None)
    );

    // Recompiling the same rules changes nothing.
    let again = compile(&v2, &ids).unwrap();
    assert!(again.rules.iter().all(|r| !r.fresh));
    assert_eq!(
        again.rules.iter().map(|r| r.id).collect::<Vec<_>>(),
        [3, 4, 0]
    );
}

#[test]
fn commit_rejects_stale_sets_and_failed_swaps_change_nothing() {
    let mut ids = RuleIds::new();
    let first = compile(&[limit("a", "10.0.0.0/8", 1)], &ids).unwrap();
    // The swap of `first` failed: no commit; the next compile assigns the same ids.
    let second = compile(&[limit("a", "10.0.0.0/8", 1)], &ids).unwrap();
    assert_eq!(first.rules[0].id, second.rules[0].id);
    ids.commit(&second).unwrap();
    assert_eq!(ids.commit(&first), Err(CompileError::StaleCompile));
    assert_eq!(ids.len(), 1);
}

#[test]
fn freed_ids_are_reused_oldest_first_after_unused_ones() {
    let mut ids = RuleIds::from_installed((0..MAX_RULES - 2).map(|i| {
        (
            format!("r{i}"),
            i,
            rule_record(&limit(&format!("r{i}"), "10.0.0.0/8", 1)),
        )
    }))
    .unwrap();
    assert_eq!(ids.len(), (MAX_RULES - 2) as usize);
    // Replace r5 then r9: fresh ids come from the two never used, then from the freed ones.
    let mut rules: Vec<RuleConfig> = (0..MAX_RULES - 2)
        .filter(|&i| i != 5)
        .map(|i| {
            limit(
                &format!("r{i}"),
                &format!("10.{}.{}.0/24", i >> 8, i & 255),
                1,
            )
        })
        .collect();
    let set = compile(&rules, &ids).unwrap();
    assert!(set.rules.iter().all(|r| !r.fresh));
    assert_eq!(ids.commit(&set).unwrap(), [5]);

    rules.push(limit("new1", "11.0.0.0/8", 1));
    rules.push(limit("new2", "12.0.0.0/8", 1));
    rules.push(limit("new3", "13.0.0.0/8", 1));
    let set = compile(&rules, &ids).unwrap();
    let fresh: Vec<u32> = set.rules.iter().filter(|r| r.fresh).map(|r| r.id).collect();
    assert_eq!(fresh, [MAX_RULES - 2, MAX_RULES - 1, 5]);
    ids.commit(&set).unwrap();

    // Every id is in use: changing a rule needs a free id during the swap.
    rules[0].rate = Some(7);
    rules[0].burst = Some(7);
    let err = compile(&rules, &ids).unwrap_err();
    assert!(
        matches!(
            err,
            CompileError::OutOfIds {
                needed: 1,
                available: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn rebuild_from_installed() {
    let mut ids = RuleIds::new();
    let rules = vec![
        limit("a", "10.0.0.0/8", 1),
        limit("b", "11.0.0.0/8", 1),
        limit("c", "12.0.0.0/8", 1),
    ];
    let set = compile(&rules, &ids).unwrap();
    ids.commit(&set).unwrap();
    let set = compile(&rules[1..], &ids).unwrap();
    ids.commit(&set).unwrap();

    // A restarted agent reads (name, id, record) back from the maps.
    let restored =
        RuleIds::from_installed(set.rules.iter().map(|r| (r.name.clone(), r.id, r.rule))).unwrap();
    let changed = vec![
        limit("b", "11.0.0.0/8", 1),
        limit("c", "12.0.0.0/8", 9),
        limit("d", "14.0.0.0/8", 1),
    ];
    let next = compile(&changed, &restored).unwrap();
    let got: Vec<_> = next
        .rules
        .iter()
        .map(|r| (r.name.as_str(), r.id, r.fresh))
        .collect();
    // Ids never used (3, 4) come before the free id 0, whose leftover state may be recent.
    assert_eq!(got, [("b", 1, false), ("c", 3, true), ("d", 4, true)]);
    assert_eq!(restored.fresh_ids().take(3).collect::<Vec<_>>(), [3, 4, 5]);
    assert_eq!(restored.fresh_ids().last(), Some(0));

    let rec = Rule::default();
    let dup_id =
        RuleIds::from_installed([("a".to_owned(), 1, rec), ("b".to_owned(), 1, rec)]).unwrap_err();
    assert!(dup_id.to_string().contains("\"b\" (id 1)"), "{dup_id}");
    assert!(RuleIds::from_installed([("a".to_owned(), 1, rec), ("a".to_owned(), 2, rec)]).is_err());
    assert!(RuleIds::from_installed([("a".to_owned(), MAX_RULES, rec)]).is_err());
}

/// Deterministic xorshift, so the tests need no extra crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn thousands_of_rules() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rules = vec![
        limit("default", "0.0.0.0/0", 1000),
        proto(limit("dns", "0.0.0.0/0", 100), Protocol::Udp, Some(53)),
    ];
    let mut seen = HashSet::new();
    while rules.len() < MAX_RULES as usize {
        let len = if rng.below(2) == 0 { 24 } else { 32 };
        let p = IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(rng.next() as u32), len)
                .unwrap()
                .trunc(),
        );
        if seen.insert(p) {
            rules.push(RuleConfig {
                action: Action::Deny,
                ..RuleConfig::new(format!("block{}", rules.len()), p)
            });
        }
    }
    let set = build(&rules);
    assert_eq!(set.prefixes.len(), rules.len() - 1); // "default" and "dns" share 0.0.0.0/0
    let ids: HashSet<u32> = set.rules.iter().map(|r| r.id).collect();
    assert_eq!(ids.len(), rules.len());
    for r in rules.iter().skip(2).take(500) {
        assert_eq!(
            set.classify(r.sources[0].network(), UDP, Some(53), 0)
                .unwrap()
                .rule
                .action,
            action::DENY
        );
    }
}

/// 100 000 deny-listed /32 and /24 prefixes in one rule (a `source_file` list) under a few broad
/// rules. Prints how long `compile` takes (run with `--release --nocapture` to measure); asserts
/// only correctness.
#[test]
fn hundred_thousand_prefixes() {
    let mut rules = vec![
        limit("default", "0.0.0.0/0", 1000),
        proto(limit("dns", "0.0.0.0/0", 100), Protocol::Udp, Some(53)),
        proto(limit("ten-tcp", "10.0.0.0/8", 100), Protocol::Tcp, None),
        with_action("office", "192.168.0.0/16", Action::Allow),
        with_action("upper", "128.0.0.0/1", Action::Deny),
    ];
    let deny_list = rules.len();
    let mut rng = Rng(42);
    let mut listed = HashSet::new();
    let mut list = Vec::new();
    while listed.len() < 100_000 {
        let len = if rng.below(2) == 0 { 24 } else { 32 };
        let p = IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(rng.next() as u32), len)
                .unwrap()
                .trunc(),
        );
        if listed.insert(p) {
            list.push(p);
        }
    }
    rules.push(proto(
        RuleConfig {
            action: Action::Deny,
            ..RuleConfig::with_sources("deny-list", list)
        },
        Protocol::Udp,
        None,
    ));
    let start = std::time::Instant::now();
    let set = build(&rules);
    println!(
        "compile: {} rules, {} prefixes in {:?}",
        set.rules.len(),
        set.prefixes.len(),
        start.elapsed()
    );
    // Every listed prefix, plus 0.0.0.0/0, 10.0.0.0/8, 192.168.0.0/16 and 128.0.0.0/1 unless
    // listed too.
    let broad_nets: HashSet<IpNet> = rules[..deny_list].iter().map(|r| r.sources[0]).collect();
    assert_eq!(
        set.prefixes.len(),
        listed.len() + broad_nets.difference(&listed).count()
    );
    assert_eq!(
        set.rule(set.rules[deny_list].id).unwrap().sources.len(),
        100_000
    );

    // Reference: the deny list (UDP only) wins inside a listed prefix, else the broad rules.
    let broad = &rules[..deny_list];
    let check = |src: Ipv4Addr, protocol: u8, port: Option<u16>| {
        let s32 = IpNet::V4(Ipv4Net::new(src, 32).unwrap());
        let s24 = IpNet::V4(Ipv4Net::new(src, 24).unwrap().trunc());
        let expected = if protocol == UDP && (listed.contains(&s32) || listed.contains(&s24)) {
            Some("deny-list")
        } else {
            reference(broad, IpAddr::V4(src), protocol, port, 0)
        };
        assert_eq!(
            set.classify(IpAddr::V4(src), protocol, port, 0)
                .map(|r| r.name.as_str()),
            expected,
            "{src}"
        );
    };
    for p in listed.iter().take(2000) {
        let IpNet::V4(p) = p else { unreachable!() };
        check(p.network(), UDP, Some(53));
        check(p.network(), TCP, Some(80));
        check(p.broadcast(), UDP, None);
    }
    for _ in 0..20_000 {
        let src = Ipv4Addr::from(rng.next() as u32);
        check(src, UDP, Some(53));
        check(src, TCP, Some(22));
        check(src, ICMP, None);
    }
}

/// The reference semantics, written independently of the candidate lists: among the rules with
/// a source prefix containing the address and whose protocol/port match the packet, the one
/// with the longest such prefix wins, then the most specific (a port outranks TCP flags, which
/// outrank the protocol alone).
fn reference(
    rules: &[RuleConfig],
    src: IpAddr,
    protocol: u8,
    port: Option<u16>,
    tcp_flags: u8,
) -> Option<&str> {
    rules
        .iter()
        .filter_map(|r| {
            let len = r
                .sources
                .iter()
                .filter(|s| s.contains(&src))
                .map(IpNet::prefix_len)
                .max()?;
            let rec = rule_record(r);
            let syn = tcp_flags & 0x12 == 0x02;
            ((rec.protocol == 0 || rec.protocol == protocol)
                && (rec.dst_port == 0 || Some(rec.dst_port) == port)
                && (r.tcp_flags.is_none() || syn))
                .then_some((len, r))
        })
        .max_by_key(|&(len, r)| {
            (
                len,
                r.dst_port.is_some(),
                r.tcp_flags.is_some(),
                r.protocol != Protocol::Any,
            )
        })
        .map(|(_, r)| r.name.as_str())
}

#[test]
fn classify_matches_reference_semantics() {
    let mut rng = Rng(7);
    let protocols = [Protocol::Any, Protocol::Tcp, Protocol::Udp, Protocol::Icmp];
    let bases = ["10.0.0.0", "10.1.0.0", "10.1.2.0", "10.1.2.3", "192.0.2.0"];
    for round in 0..200 {
        let mut rules = Vec::new();
        let mut taken = HashSet::new();
        for i in 0..rng.below(12) + 1 {
            let base: Ipv4Addr = bases[rng.below(bases.len() as u64) as usize]
                .parse()
                .unwrap();
            let len = [0, 8, 16, 24, 32][rng.below(5) as usize];
            let source = IpNet::V4(Ipv4Net::new(base, len).unwrap().trunc());
            let protocol = protocols[rng.below(4) as usize];
            let port = match protocol {
                Protocol::Tcp | Protocol::Udp if rng.below(2) == 0 => {
                    Some(53 + rng.below(2) as u16)
                }
                _ => None,
            };
            let flags = (protocol == Protocol::Tcp && rng.below(2) == 0).then_some(TcpFlags::Syn);
            if !taken.insert((source, protocol, port, flags)) {
                continue;
            }
            let action = [Action::Limit, Action::Allow, Action::Deny][rng.below(3) as usize];
            let r = match action {
                Action::Limit => limit(&format!("r{i}"), &source.to_string(), 1 + rng.below(5)),
                a => with_action(&format!("r{i}"), &source.to_string(), a),
            };
            let mut r = proto(r, protocol, port);
            r.tcp_flags = flags;
            rules.push(r);
        }
        let set = match compile(&rules, &RuleIds::new()) {
            Ok(set) => set,
            Err(CompileError::TooManyCandidates { .. }) => continue,
            Err(e) => panic!("round {round}: {e}"),
        };
        for _ in 0..50 {
            let src = IpAddr::V4(Ipv4Addr::from(
                u32::from(bases[rng.below(5) as usize].parse::<Ipv4Addr>().unwrap())
                    + rng.below(4) as u32,
            ));
            // TCP packets with no flag, SYN, SYN-ACK or ACK (flags only where the header was read).
            let flags = [0, 0x02, 0x12, 0x10][rng.below(4) as usize];
            let (protocol, port) = match rng.below(6) {
                0 | 5 => (TCP, Some(53 + rng.below(3) as u16)),
                1 => (UDP, Some(53 + rng.below(3) as u16)),
                2 => (UDP, None),
                3 => (ICMP, None),
                _ => (47, None),
            };
            let flags = if protocol == TCP && port.is_some() {
                flags
            } else {
                0
            };
            assert_eq!(
                set.classify(src, protocol, port, flags)
                    .map(|r| r.name.as_str()),
                reference(&rules, src, protocol, port, flags),
                "round {round}: {src} {protocol} {port:?} flags {flags:#x} with {rules:#?}"
            );
        }
    }
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

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn multi(name: &str, sources: &[&str], action: Action) -> RuleConfig {
    let mut r = RuleConfig {
        action,
        ..RuleConfig::with_sources(name, nets(sources))
    };
    if action == Action::Limit {
        r.rate = Some(10);
        r.burst = Some(10);
    }
    r
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

/// Random rule sets with many prefixes per rule (nested, shared between rules, both families)
/// against the brute-force reference.
#[test]
fn classify_matches_reference_with_prefix_lists() {
    let mut rng = Rng(0x5eed);
    // A pool of nested prefixes, so that rules overlap a lot.
    let mut pool: Vec<IpNet> = Vec::new();
    for _ in 0..120 {
        let region = [0x0a00_0000u32, 0x0a01_0000, 0xc000_0200][rng.below(3) as usize];
        let addr = region | (rng.below(1 << 12) as u32);
        let len = [0, 8, 12, 16, 20, 24, 28, 30, 32][rng.below(9) as usize];
        pool.push(IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(addr), len).unwrap().trunc(),
        ));
    }
    for _ in 0..60 {
        let region: u128 =
            [0x2001_0db8 << 96, (0x2001_0db8 << 96) | (1 << 80)][rng.below(2) as usize];
        let addr = region | u128::from(rng.below(1 << 12));
        let len = [0, 16, 32, 48, 64, 120, 124, 128][rng.below(8) as usize];
        pool.push(IpNet::V6(
            Ipv6Net::new(Ipv6Addr::from(addr), len).unwrap().trunc(),
        ));
    }
    let combos = [
        (Protocol::Any, None),
        (Protocol::Tcp, None),
        (Protocol::Udp, None),
        (Protocol::Icmp, None),
        (Protocol::Tcp, Some(80)),
        (Protocol::Udp, Some(53)),
        (Protocol::Tcp, Some(443)),
        // SYN rules: see below.
        (Protocol::Tcp, None),
        (Protocol::Tcp, Some(80)),
    ];
    let (mut checked, mut conflicts) = (0, 0);
    for round in 0..300 {
        let mut rules = Vec::new();
        for i in 0..rng.below(8) + 1 {
            let count = rng.below(40) as usize + 1;
            // Duplicates within a rule are fine: they are merged.
            let sources: Vec<IpNet> = (0..count)
                .map(|_| pool[rng.below(pool.len() as u64) as usize])
                .collect();
            let combo = rng.below(combos.len() as u64) as usize;
            let (mut protocol, port) = combos[combo];
            let r = RuleConfig::with_sources(format!("r{i}"), sources);
            if protocol == Protocol::Icmp && r.families() == (true, true) {
                protocol = Protocol::Any;
            }
            let action = [Action::Limit, Action::Allow, Action::Deny][rng.below(3) as usize];
            let mut r = RuleConfig { action, ..r };
            if action == Action::Limit {
                r.rate = Some(1);
                r.burst = Some(1);
            }
            let mut r = proto(r, protocol, port);
            r.tcp_flags = (combo >= 7).then_some(TcpFlags::Syn);
            rules.push(r);
        }
        // Brute force: two rules sharing a prefix with the same protocol, port and flags
        // conflict.
        let expect_conflict = rules.iter().enumerate().any(|(i, a)| {
            rules[i + 1..].iter().any(|b| {
                (a.protocol, a.dst_port, a.tcp_flags) == (b.protocol, b.dst_port, b.tcp_flags)
                    && a.sources.iter().any(|s| b.sources.contains(s))
            })
        });
        let set = match compile(&rules, &RuleIds::new()) {
            Ok(set) => set,
            Err(CompileError::Conflict { .. }) if expect_conflict => {
                conflicts += 1;
                continue;
            }
            Err(CompileError::TooManyCandidates { .. }) if !expect_conflict => continue,
            Err(e) => panic!("round {round}: {e}"),
        };
        assert!(!expect_conflict, "round {round}: conflict not detected");
        checked += 1;
        let used: Vec<IpNet> = rules.iter().flat_map(|r| r.sources.clone()).collect();
        for _ in 0..200 {
            let src = match used[rng.below(used.len() as u64) as usize] {
                IpNet::V4(p) => {
                    let host = (rng.next() as u32) & !u32::from(p.netmask());
                    IpAddr::V4(Ipv4Addr::from(u32::from(p.network()) | host))
                }
                IpNet::V6(p) => {
                    let host = u128::from(rng.next()) & !u128::from(p.netmask());
                    IpAddr::V6(Ipv6Addr::from(u128::from(p.network()) | host))
                }
            };
            let flags = [0, 0x02, 0x12, 0x10][rng.below(4) as usize];
            let (protocol, port) = match rng.below(7) {
                0 => (TCP, Some(80)),
                1 => (TCP, Some(443 + rng.below(2) as u16)),
                2 => (UDP, Some(53)),
                3 => (UDP, None),
                4 => (ICMP, None),
                5 => (ICMPV6, None),
                _ => (47, None),
            };
            let flags = if protocol == TCP { flags } else { 0 };
            assert_eq!(
                set.classify(src, protocol, port, flags)
                    .map(|r| r.name.as_str()),
                reference(&rules, src, protocol, port, flags),
                "round {round}: {src} {protocol} {port:?} flags {flags:#x}"
            );
        }
    }
    // The generator must exercise both outcomes.
    assert!(
        checked >= 100 && conflicts >= 10,
        "{checked} checked, {conflicts} conflicts"
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

/// A rule's `[[rule.limit]]`s become its record's `extra` limits, in order, each with its own
/// mask, intervals and flags; the coarse clock only when every limit allows it; a change of a
/// limit is a change of the rule (a fresh id, fresh buckets).
#[test]
fn limits_compile_in_order_with_their_own_masks() {
    use crate::config::LimitConfig;
    let mut r = limit("web", "0.0.0.0/0", 1000);
    let mut net24 = LimitConfig::new(Per::Prefix(24));
    (net24.rate, net24.burst) = (Some(20_000), Some(40_000));
    let mut all = LimitConfig::new(Per::Rule);
    (all.bytes_rate, all.bytes_burst) = (Some(1_000_000), Some(2_000_000));
    r.limits = vec![net24, all];
    let rec = rule_record(&r);
    assert_eq!(rec.limits(), 3);
    assert_eq!(rec.extra_len, 2);
    assert_eq!(rec.src_mask, [u32::MAX, 0, 0, 0]);
    assert_eq!(rec.pkt_interval_ns, 1_000_000);
    let l1 = rec.limit(1).unwrap();
    assert_eq!(l1.src_mask[0], u32::from_ne_bytes([255, 255, 255, 0]));
    assert_eq!(
        (l1.pkt_interval_ns, l1.pkt_tolerance_ns),
        (50_000, 2_000_000_000)
    );
    // The rule's clock is every limit's: its charges read the flag from the limit's own.
    // (COARSE_ONLY too on a kernel of 1,000 ticks a second; else BORN_COARSE, its burst of
    // 40,000 packets being far over 100.)
    assert_eq!(
        l1.flags & !(rule_flags::COARSE_ONLY | rule_flags::BORN_COARSE),
        rule_flags::PKT_LIMIT | rule_flags::COARSE_CLOCK
    );
    assert_ne!(
        l1.flags & (rule_flags::COARSE_ONLY | rule_flags::BORN_COARSE),
        0
    );
    let l2 = rec.limit(2).unwrap();
    assert_eq!(l2.src_mask, [0; 4]);
    assert_eq!(
        l2.flags & !rule_flags::COARSE_ONLY,
        rule_flags::BYTE_LIMIT | rule_flags::COARSE_CLOCK
    );
    assert_eq!(l2.byte_tolerance_ns, 2_000_000_000);
    assert!(rec.limit(3).is_none());
    assert_ne!(rec.flags & rule_flags::COARSE_CLOCK, 0);
    // A limit with a tolerance under the coarse clock's ticks takes the whole rule off it.
    r.limits[1].bytes_burst = Some(10_000);
    assert_eq!(rule_record(&r).flags & rule_flags::COARSE_CLOCK, 0);
    assert_eq!(
        rule_record(&r).limit(1).unwrap().flags & rule_flags::COARSE_CLOCK,
        0
    );
    r.limits[1].bytes_burst = Some(2_000_000);
    // Changing a limit changes the record: the rule gets a fresh id on reload.
    let set = build(std::slice::from_ref(&r));
    let mut ids = RuleIds::new();
    ids.commit(&set).unwrap();
    r.limits[0].rate = Some(30_000);
    let again = compile(std::slice::from_ref(&r), &ids).unwrap();
    assert!(again.rules[0].fresh);
}

/// The first `per = "rule"` limit with a packet rate gates the rule (`rule_flags::GATE`, with
/// its index): wherever it is written, and only a packet limit (a byte-only aggregate cannot
/// drop by a window) of one bucket for the whole rule (a `/N` limit is not one).
#[test]
fn a_per_rule_packet_limit_gates_the_rule() {
    use crate::config::LimitConfig;
    let gate = |rec: &Rule| {
        (rec.flags & rule_flags::GATE != 0).then_some(rule_flags::gate_limit(rec.flags))
    };
    let mut r = limit("web", "0.0.0.0/0", 1000);
    assert_eq!(gate(&rule_record(&r)), None, "per source alone");
    let mut net8 = LimitConfig::new(Per::Prefix(8));
    (net8.rate, net8.burst) = (Some(20_000), Some(40_000));
    let mut bytes = LimitConfig::new(Per::Rule);
    (bytes.bytes_rate, bytes.bytes_burst) = (Some(1_000_000), Some(2_000_000));
    let mut all = LimitConfig::new(Per::Rule);
    (all.rate, all.burst) = (Some(100_000), Some(1_000));
    r.limits = vec![net8.clone(), bytes.clone()];
    assert_eq!(
        gate(&rule_record(&r)),
        None,
        "a /8 and a byte-only aggregate"
    );
    r.limits = vec![net8, bytes, all];
    assert_eq!(gate(&rule_record(&r)), Some(3));
    // The rule's own limit per rule (IPv6 too: the mask is zero in every word).
    let mut own = limit("agg", "::/0", 10_000);
    own.per = Per::Rule;
    let mut src = LimitConfig::new(Per::Source);
    (src.rate, src.burst) = (Some(100), Some(200));
    own.limits = vec![src];
    let rec = rule_record(&own);
    assert_eq!(gate(&rec), Some(0));
    // The other flags are untouched.
    assert_ne!(rec.flags & rule_flags::PKT_LIMIT, 0);
}

/// The IPv4 table's word of the /16 holding `addr`.
fn table_word(table: &[u32], addr: &str) -> u32 {
    let a: Ipv4Addr = addr.parse().unwrap();
    let [x, y, _, _] = a.octets();
    table[v4_table::index(0, [x, y]) as usize]
}

/// The IPv4 table holds an outcome only where the trie's lookup and walk give one for the whole
/// /16, and it is the one the walk gives: the longest covering prefix of /16 or shorter, when
/// its first candidate looks at no protocol, port or flag and no longer prefix lies inside.
#[test]
fn the_ipv4_table_holds_a_16s_outcome_only_where_it_is_one() {
    let mut syn = proto(limit("syn", "10.3.0.0/16", 5), Protocol::Tcp, None);
    syn.tcp_flags = Some(TcpFlags::Syn);
    let set = build(&[
        limit("all", "0.0.0.0/0", 1),
        limit("ten", "10.0.0.0/8", 2),
        limit("ten-one", "10.1.0.0/16", 3),
        limit("ten-one-two", "10.1.2.0/24", 4),
        proto(limit("web", "10.2.0.0/16", 6), Protocol::Tcp, Some(80)),
        syn,
        limit("v6", "::/0", 7),
    ]);
    let table = set.v4_table();
    assert_eq!(table.len(), v4_table::SLOTS as usize);
    let direct = |name: &str| v4_table::direct(Some(set.by_name(name).unwrap().id));
    // Covered by /0 only; by /8; by /16 (its own, longest).
    assert_eq!(table_word(&table, "192.0.2.1"), direct("all"));
    assert_eq!(table_word(&table, "10.200.0.1"), direct("ten"));
    assert_eq!(
        table_word(&table, "10.1.200.1"),
        v4_table::TRIE,
        "a /24 inside"
    );
    // A first candidate with a port or TCP flags: the outcome depends on the packet.
    assert_eq!(table_word(&table, "10.2.0.1"), v4_table::TRIE);
    assert_eq!(table_word(&table, "10.3.0.1"), v4_table::TRIE);
    // Without a /0, an uncovered /16 holds "no rule"; IPv6 prefixes write nothing.
    let bare = build(&[limit("ten", "10.0.0.0/8", 2), limit("v6", "::/0", 7)]);
    let t = bare.v4_table();
    assert_eq!(table_word(&t, "192.0.2.1"), v4_table::direct(None));
    assert_eq!(
        table_word(&t, "10.9.0.1"),
        v4_table::direct(Some(bare.by_name("ten").unwrap().id))
    );
    assert_eq!(
        build(&[]).v4_table(),
        vec![v4_table::direct(None); v4_table::SLOTS as usize]
    );
}

/// Over random rule sets (nested prefixes of every length, some with protocols, ports or TCP
/// flags), every address of every /16 the table holds an outcome for classifies to that outcome
/// in the reference walk, whatever the packet's protocol, port and flags.
#[test]
fn the_ipv4_tables_outcomes_agree_with_the_walk() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut direct_words = 0usize;
    for round in 0..40 {
        let mut rules = Vec::new();
        for n in 0..(4 + next() % 12) {
            // Addresses in 10.0.0.0/14, so prefixes nest and overlap often.
            let addr = 0x0a00_0000u32 | (next() as u32 & 0x0003_ffff);
            let len = [0u8, 8, 12, 14, 15, 16, 16, 17, 20, 24, 32][next() as usize % 11];
            let base = u32::from(Ipv4Addr::from(addr))
                & u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            let source = format!("{}/{len}", Ipv4Addr::from(base));
            let mut r = limit(&format!("r{round}-{n}"), &source, 1 + n);
            match next() % 4 {
                0 => r = proto(r, Protocol::Udp, Some(53)),
                1 => {
                    r = proto(r, Protocol::Tcp, None);
                    if next() % 2 == 0 {
                        r.tcp_flags = Some(TcpFlags::Syn);
                    }
                }
                _ => {}
            }
            rules.push(r);
        }
        let Ok(set) = compile(&rules, &RuleIds::new()) else {
            continue;
        };
        let table = set.v4_table();
        for (slot, &word) in table.iter().enumerate() {
            let Some(want) = v4_table::outcome(word) else {
                continue;
            };
            // Only the /16s of 10.0.0.0/14 and two others: the rest hold the /0's outcome.
            if !(0x0a00..0x0a04).contains(&slot) && slot != 0 && slot != 0xc000 {
                continue;
            }
            direct_words += 1;
            for _ in 0..8 {
                let addr = (slot as u32) << 16 | (next() as u32 & 0xffff);
                for (protocol, port, flags) in [
                    (UDP, Some(53), 0),
                    (TCP, Some(80), 0x02),
                    (TCP, Some(80), 0x10),
                    (ICMP, None, 0),
                ] {
                    let got = set
                        .classify(IpAddr::V4(addr.into()), protocol, port, flags)
                        .map(|r| r.id);
                    assert_eq!(
                        got,
                        want,
                        "round {round}: {} under {rules:?}",
                        Ipv4Addr::from(addr)
                    );
                }
            }
        }
    }
    assert!(
        direct_words > 40,
        "the table held too few outcomes to test ({direct_words})"
    );
}
