//! The compiled rule record: its limits' intervals and tolerances, flags and masks, the clocks
//! a limit runs on, first packets free, drop windows held, and several limits in order.

use super::*;

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
