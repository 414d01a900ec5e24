//! Hot frames: one frame run again and again, for the limiter's fast path on a known source
//! (admitted, dropped, IPv6, fragments, TCP flags, rules with 1 to 3 limits, 10,000 more rules),
//! each case against the XDP_PASS floor measured in the same runs.

use anyhow::{bail, Context as _, Result};
use ratelimit_common::rule_flags;
use ratelimit_testbed::packet::eth;
use serde_json::json;

use super::{action_name, repeat_ns, v4_frame, v6_frame, Limiter, SECTION, TRUNCATION};
use crate::{
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
};

/// A hot case: one frame, run `repeat` times per run.
struct HotCase {
    key: &'static str,
    label: &'static str,
    frame: Vec<u8>,
    kernel: Vec<f64>,
    wall: Vec<f64>,
    action: u32,
}

impl HotCase {
    fn new(key: &'static str, label: &'static str, frame: Vec<u8>) -> Self {
        Self {
            key,
            label,
            frame,
            kernel: Vec::new(),
            wall: Vec::new(),
            action: 0,
        }
    }
}

/// Measures `cases` (limiter) and the floor, interleaved: each run measures every case once.
fn measure_hot(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    floor_key: &str,
    cases: &mut [HotCase],
) -> Result<()> {
    let floor_frame = v4_frame([198, 18, 0, 1]);
    let (mut floor, mut floor_wall) = (Vec::new(), Vec::new());
    // Warm up: create the buckets, spend the `drop` rules' bursts (2,000 for `drop-1k`).
    for c in cases.iter() {
        repeat_ns(limiter.program(), &c.frame, 3000)?;
    }
    for _ in 0..opts.runs {
        crate::session::check_interrupted()?;
        let (k, w, _) = repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?;
        floor.push(k + TRUNCATION);
        floor_wall.push(w);
        for c in cases.iter_mut() {
            let (k, w, action) = repeat_ns(limiter.program(), &c.frame, opts.repeat)?;
            c.kernel.push(k + TRUNCATION);
            c.wall.push(w);
            c.action = action;
        }
    }
    if report.get(floor_key).is_none() {
        report.add(Figure {
            key: floor_key.into(),
            section: SECTION,
            label: "floor: XDP_PASS program (bench_pass), hot frame".into(),
            unit: "ns/pkt",
            runs: floor,
            baseline: None,
            detail: json!({ "repeat": opts.repeat, "wall_ns_per_run": floor_wall }),
        });
    }
    for c in cases.iter() {
        report.add(Figure {
            key: c.key.into(),
            section: SECTION,
            label: c.label.into(),
            unit: "ns/pkt",
            runs: c.kernel.clone(),
            baseline: Some(floor_key.into()),
            detail: json!({
                "repeat": opts.repeat,
                "wall_ns_per_run": c.wall,
                "xdp_action": action_name(c.action),
            }),
        });
    }
    Ok(())
}

/// The hot cases of the issue, plus the variants that show where the time goes.
fn hot_cases() -> Vec<HotCase> {
    vec![
        HotCase::new(
            "kernel.limiter.admitted",
            "limiter: known source, admitted (coarse clock)",
            v4_frame([198, 18, 0, 1]),
        ),
        HotCase::new(
            "kernel.limiter.dropped",
            "limiter: known source, dropped (drop window)",
            v4_frame([198, 18, 2, 1]),
        ),
        HotCase::new(
            "kernel.limiter.dropped_1k",
            "limiter: known source, dropped at 1,000/s (1 ms windows, held)",
            v4_frame([198, 18, 17, 1]),
        ),
        HotCase::new(
            "kernel.limiter.dropped_1k_per24",
            "limiter: known source, dropped at 1,000/s per /24 (1 ms windows, precise clock)",
            v4_frame([198, 18, 18, 1]),
        ),
        HotCase::new(
            "kernel.limiter.ipv6",
            "limiter: IPv6 known source, admitted",
            v6_frame(),
        ),
        HotCase::new(
            "kernel.limiter.ipv6_3ext",
            "limiter: IPv6 known source behind 3 extension headers, admitted",
            eth()
                .ipv6(
                    "2001:db8::1".parse().expect("address"),
                    "2001:db8::2".parse().expect("address"),
                )
                .ext(0, 0)
                .ext(43, 0)
                .ext(60, 0)
                .udp(40_000, 9)
                .pad_to(102)
                .build(),
        ),
        // A datagram's first fragment, then one of its others: the first looks its datagram up in
        // the fragment table (inserted by the warm-up), the other follows it.
        HotCase::new(
            "kernel.limiter.first_fragment",
            "limiter: IPv4 first fragment, admitted (fragment table lookup)",
            eth()
                .ipv4([198, 18, 0, 1].into(), [198, 18, 255, 254].into())
                .udp(40_000, 9)
                .frag(0, true)
                .ident(77)
                .pad_to(60)
                .build(),
        ),
        HotCase::new(
            "kernel.limiter.later_fragment",
            "limiter: IPv4 later fragment, admitted (follows its first)",
            eth()
                .ipv4([198, 18, 0, 1].into(), [198, 18, 255, 254].into())
                .proto(17)
                .payload(26)
                .frag(3, false)
                .ident(77)
                .build(),
        ),
        HotCase::new(
            "kernel.limiter.admitted_coarse_only",
            "variant: admitted, coarse clock alone (tolerance >= 100 lags)",
            v4_frame([198, 18, 16, 1]),
        ),
        HotCase::new(
            "kernel.limiter.admitted_precise_clock",
            "variant: admitted, precise clock (tolerance < 20 ms)",
            v4_frame([198, 18, 1, 1]),
        ),
        HotCase::new(
            "kernel.limiter.allow_rule",
            "variant: allow rule (parse, classify, count; no bucket)",
            v4_frame([198, 18, 3, 1]),
        ),
        HotCase::new(
            "kernel.limiter.no_match",
            "variant: no rule matches (parse, cached classification)",
            v4_frame([198, 19, 0, 1]),
        ),
    ]
}

/// The hot-path figures.
pub fn hot(report: &mut Report, opts: &Options, refs: &Refs, limiter: &Limiter) -> Result<()> {
    crate::session::announce("in-kernel cost: floor and limiter, hot frames");
    for (name, coarse, only) in [
        ("admit", true, false),
        ("admit-coarse-only", true, true),
        ("admit-precise-clock", false, false),
    ] {
        let rule = limiter
            .set
            .rule(limiter.id(name)?)
            .context("rule in set")?
            .rule;
        if (rule.flags & rule_flags::COARSE_CLOCK != 0) != coarse
            || (rule.flags & rule_flags::COARSE_ONLY != 0) != only
        {
            bail!(
                "rule {name}: expected the {} clock",
                match (coarse, only) {
                    (true, true) => "coarse clock alone",
                    (true, false) => "coarse",
                    _ => "precise",
                }
            );
        }
    }
    let mut cases = hot_cases();
    measure_hot(report, opts, refs, limiter, "kernel.floor", &mut cases)
}

/// The hot admitted case again, with the 10,000 extra rules of [`crate::rules::many_rules`]
/// installed (a prefix trie of as many more prefixes).
pub fn hot_with_rules(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    let mut cases = vec![HotCase::new(
        "kernel.limiter.admitted_10k_rules",
        "variant: admitted, with 10,000 more rules installed",
        v4_frame([198, 18, 0, 1]),
    )];
    measure_hot(
        report,
        opts,
        refs,
        limiter,
        "kernel.floor_10k_rules",
        &mut cases,
    )?;
    if let Some(f) = report
        .figures
        .iter_mut()
        .find(|f| f.key == "kernel.floor_10k_rules")
    {
        f.label = "floor: XDP_PASS, re-measured next to the 10,000-rule case".into();
    }
    Ok(())
}

/// Rules for [`hot_tcp_flags`]: a port rule, a protocol rule, and a SYN rule beside a protocol
/// rule, each on its own /24, all admitting everything.
pub const TCP_RULES: &str = r#"
[[rule]]
name = "tcp-port"
source = "198.18.4.0/24"
protocol = "tcp"
dst_port = 443
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tcp-syn"
source = "198.18.5.0/24"
protocol = "tcp"
tcp_flags = "syn"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tcp-beside-syn"
source = "198.18.5.0/24"
protocol = "tcp"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tcp-any-flags"
source = "198.18.6.0/24"
protocol = "tcp"
rate = 1000000000
burst = 1000000000
"#;

/// Rules for [`hot_limits`]: one, two and three limits (per source; + per /24; + per rule), each
/// rule on its own /24, all admitting everything (on the coarse clock, as a one-limit rule).
pub const LIMIT_RULES: &str = r#"
[[rule]]
name = "limits-1"
source = "198.18.7.0/24"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "limits-2"
source = "198.18.8.0/24"
rate = 1000000000
burst = 1000000000
[[rule.limit]]
per = "/24"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "limits-3"
source = "198.18.9.0/24"
rate = 1000000000
burst = 1000000000
[[rule.limit]]
per = "/24"
rate = 1000000000
burst = 1000000000
[[rule.limit]]
per = "rule"
rate = 1000000000
burst = 1000000000
"#;

/// The cost of several limits per rule: a known source's admitted packet under a rule with one,
/// two and three limits (each extra limit is one more bucket charge). Expects [`LIMIT_RULES`]
/// installed.
pub fn hot_limits(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    crate::session::announce("in-kernel cost: rules with 1, 2 and 3 limits");
    for (name, n) in [("limits-1", 1), ("limits-2", 2), ("limits-3", 3)] {
        let rule = limiter
            .set
            .rule(limiter.id(name)?)
            .context("rule in set")?
            .rule;
        if rule.limits() != n || rule.flags & rule_flags::COARSE_CLOCK == 0 {
            bail!("rule {name}: expected {n} limits on the coarse clock");
        }
    }
    let mut cases = vec![
        HotCase::new(
            "kernel.limiter.limits_1",
            "limits: known source, admitted, rule with 1 limit",
            v4_frame([198, 18, 7, 1]),
        ),
        HotCase::new(
            "kernel.limiter.limits_2",
            "limits: known source, admitted, 2 limits (+ per /24)",
            v4_frame([198, 18, 8, 1]),
        ),
        HotCase::new(
            "kernel.limiter.limits_3",
            "limits: known source, admitted, 3 limits (+ /24 + rule)",
            v4_frame([198, 18, 9, 1]),
        ),
    ];
    measure_hot(
        report,
        opts,
        refs,
        limiter,
        "kernel.floor_limits",
        &mut cases,
    )?;
    if let Some(f) = report
        .figures
        .iter_mut()
        .find(|f| f.key == "kernel.floor_limits")
    {
        f.label = "floor: XDP_PASS, re-measured next to the limits cases".into();
    }
    Ok(())
}

fn tcp_frame(src: [u8; 4], flags: u8) -> Vec<u8> {
    eth()
        .ipv4(src.into(), [198, 18, 255, 254].into())
        .tcp(40_000, 443)
        .tcp_flags(flags)
        .pad_to(60)
        .build()
}

/// The cost of classifying by TCP flags: a SYN under a SYN rule, and an ACK from a source whose
/// prefix has one (the walk tries the SYN rule first), against a port rule and a protocol rule.
/// Expects [`TCP_RULES`] installed.
pub fn hot_tcp_flags(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    crate::session::announce("in-kernel cost: TCP port, protocol and SYN rules");
    let mut cases = vec![
        HotCase::new(
            "kernel.limiter.tcp_port_rule",
            "TCP: SYN under a protocol+port rule, admitted",
            tcp_frame([198, 18, 4, 1], 0x02),
        ),
        HotCase::new(
            "kernel.limiter.tcp_protocol_rule",
            "TCP: ACK under a protocol rule (no flag rule for the source), admitted",
            tcp_frame([198, 18, 6, 1], 0x10),
        ),
        HotCase::new(
            "kernel.limiter.syn_rule",
            "TCP: SYN under a tcp_flags = \"syn\" rule, admitted",
            tcp_frame([198, 18, 5, 1], 0x02),
        ),
        HotCase::new(
            "kernel.limiter.syn_rule_ack",
            "TCP: ACK past a SYN rule to its prefix's protocol rule, admitted",
            tcp_frame([198, 18, 5, 2], 0x10),
        ),
    ];
    measure_hot(report, opts, refs, limiter, "kernel.floor_tcp", &mut cases)?;
    if let Some(f) = report
        .figures
        .iter_mut()
        .find(|f| f.key == "kernel.floor_tcp")
    {
        f.label = "floor: XDP_PASS, re-measured next to the TCP cases".into();
    }
    Ok(())
}
