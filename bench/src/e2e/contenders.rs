//! The contenders that receive the flood: the limiter (with one or two limits), the floors,
//! nftables and iptables; how each is attached and detached, and what each counts itself.

use anyhow::{Context as _, Result};
use aya::programs::XdpMode;
use ratelimit::{config::Config, dataplane::AttachMode};
use ratelimit_common::verdict;
use ratelimit_testbed::{in_netns, Netns};

use super::{
    Testbed, AGGREGATE_BURST, AGGREGATE_RATE, BURST, E2E_RULES, KNOWN_NET, LAYERED_FIRST_RULES,
    LAYERED_RULES, RATE, TRACKED,
};
use crate::{
    kernel::Limiter,
    lru::{Gcra, Kind},
    refs::{Refs, DROP, PASS, READ_DROP},
};

/// What receives the flood.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Contender {
    DropAll,
    /// [`Contender::DropAll`] again, measured in turns with the layered cases (see
    /// [`LAYERED_GROUP`]), which are compared with it: the first floor was measured minutes
    /// earlier, and this machine's floor moved by up to 10% between measurements a few minutes
    /// apart (1.80 and 1.94 Mpps in one run).
    DropAllLayered,
    /// An XDP program that reads the frame's source, then drops it ([`READ_DROP`]): what any
    /// per-source limiter's drop costs at least, beside [`Contender::DropAll`].
    ReadDrop,
    Limiter,
    Pass,
    Nft,
    Iptables,
    /// The limiter with [`LAYERED_RULES`].
    LimiterAggregate,
    /// The limiter with [`LAYERED_FIRST_RULES`].
    LimiterAggregateFirst,
    /// nftables with the same two-level policy.
    NftAggregate,
    /// nftables with the two levels the other way round (the global limit first).
    NftAggregateFirst,
    /// The LRU contender ([`crate::lru`]): GCRA per source in an XDP program over an
    /// `LRU_HASH` of [`TRACKED`] entries.
    Lru,
    /// The same over an `LRU_PERCPU_HASH`.
    LruPerCpu,
}

impl Contender {
    pub(super) fn tag(self) -> &'static str {
        match self {
            Contender::DropAll => "drop_all",
            Contender::DropAllLayered => "drop_all_layered",
            Contender::ReadDrop => "read_drop",
            Contender::Limiter => "limiter",
            Contender::Pass => "xdp_pass",
            Contender::Nft => "nftables",
            Contender::Iptables => "iptables",
            Contender::LimiterAggregate => "limiter_aggregate",
            Contender::LimiterAggregateFirst => "limiter_aggregate_first",
            Contender::NftAggregate => "nftables_aggregate",
            Contender::NftAggregateFirst => "nftables_aggregate_first",
            Contender::Lru => "lru",
            Contender::LruPerCpu => "lru_percpu",
        }
    }

    /// The limiter's rule the flood meets, for its counters.
    fn rule(self) -> &'static str {
        if self.layered() {
            "layered"
        } else {
            "per-source"
        }
    }

    /// The limiter's rule the polite source meets.
    pub(super) fn polite_rule(self) -> &'static str {
        if self.layered() {
            "known"
        } else {
            "per-source"
        }
    }

    /// The limiter with a per-source and a per-rule limit.
    pub(super) fn layered(self) -> bool {
        matches!(
            self,
            Contender::LimiterAggregate | Contender::LimiterAggregateFirst
        )
    }

    /// A drop-all floor.
    pub(super) fn floor(self) -> bool {
        matches!(
            self,
            Contender::DropAll | Contender::DropAllLayered | Contender::ReadDrop
        )
    }

    /// A contender (or the floor) of the aggregate case.
    pub(super) fn aggregate(self) -> bool {
        self.layered()
            || matches!(
                self,
                Contender::NftAggregate | Contender::NftAggregateFirst | Contender::DropAllLayered
            )
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Contender::DropAll => "floor: XDP program dropping everything (bench_drop)",
            Contender::DropAllLayered => {
                "floor: XDP program dropping everything (bench_drop), re-measured next to these"
            }
            Contender::ReadDrop => {
                "floor: XDP program reading the frame's source, then dropping it (rlb_read_drop)"
            }
            Contender::Limiter => "limiter (XDP, 1000/s burst 2000 per source)",
            Contender::Pass => "XDP_PASS receiver, everything to the stack",
            Contender::Nft => "nftables: netdev ingress, dynamic set, limit rate over",
            Contender::Iptables => "iptables: raw PREROUTING, hashlimit per srcip",
            Contender::LimiterAggregate => {
                "limiter: 1000/s per source + 10,000/s per rule ([[rule.limit]])"
            }
            Contender::LimiterAggregateFirst => {
                "limiter: the same two limits, the per-rule one first (the rule's own)"
            }
            Contender::NftAggregate => {
                "nftables: dynamic set per source + global limit rate over 10,000/s"
            }
            Contender::NftAggregateFirst => "nftables: the same two levels, the global limit first",
            Contender::Lru => "LRU contender: XDP, GCRA per source in an LRU_HASH of 2^20",
            Contender::LruPerCpu => "LRU contender: the same in an LRU_PERCPU_HASH of 2^20",
        }
    }

    /// The LRU contender's map, if this is one.
    fn lru_kind(self) -> Option<Kind> {
        match self {
            Contender::Lru => Some(Kind::Shared),
            Contender::LruPerCpu => Some(Kind::PerCpu),
            _ => None,
        }
    }
}

/// Attached contender, for teardown.
pub(super) enum Attached {
    Ref(&'static str, aya::programs::xdp::XdpLinkId),
    Limiter,
    Lru(Kind, aya::programs::xdp::XdpLinkId),
}

/// Every contender, for `--contenders`.
pub(super) const ALL: [Contender; 13] = [
    Contender::DropAll,
    Contender::DropAllLayered,
    Contender::ReadDrop,
    Contender::Limiter,
    Contender::Pass,
    Contender::Nft,
    Contender::Iptables,
    Contender::LimiterAggregate,
    Contender::LimiterAggregateFirst,
    Contender::NftAggregate,
    Contender::NftAggregateFirst,
    Contender::Lru,
    Contender::LruPerCpu,
];

pub(super) fn setup(
    refs: &mut Refs,
    bed: &Testbed,
    limiter: &mut Limiter,
    contender: Contender,
) -> Result<Attached> {
    let ns = &bed.rx;
    let dev = bed.rx_if.as_str();
    Ok(match contender {
        Contender::DropAll | Contender::DropAllLayered => {
            Attached::Ref(DROP, refs.attach(DROP, ns, dev)?)
        }
        Contender::ReadDrop => Attached::Ref(READ_DROP, refs.attach(READ_DROP, ns, dev)?),
        Contender::Pass => Attached::Ref(PASS, refs.attach(PASS, ns, dev)?),
        Contender::Limiter => {
            let dp = limiter.tdp.dataplane();
            in_netns(ns, || dp.attach(dev, AttachMode::Native).map(|_| ()))?;
            Attached::Limiter
        }
        Contender::LimiterAggregate | Contender::LimiterAggregateFirst => {
            let rules = if contender == Contender::LimiterAggregate {
                LAYERED_RULES
            } else {
                LAYERED_FIRST_RULES
            };
            limiter.install(&Config::parse(rules, "bench.toml")?.rules)?;
            let dp = limiter.tdp.dataplane();
            in_netns(ns, || dp.attach(dev, AttachMode::Native).map(|_| ()))?;
            Attached::Limiter
        }
        Contender::NftAggregate | Contender::NftAggregateFirst => {
            let link = refs.attach(PASS, ns, dev)?;
            bed.nft(&nft_aggregate(contender, dev))?;
            Attached::Ref(PASS, link)
        }
        Contender::Nft => {
            let link = refs.attach(PASS, ns, dev)?;
            bed.nft(&format!(
                "table netdev rlbench {{
                    set sources {{
                        type ipv4_addr
                        size {TRACKED}
                        flags dynamic,timeout
                        timeout 60s
                    }}
                    chain ingress {{
                        type filter hook ingress device \"{dev}\" priority filter; policy accept;
                        update @sources {{ ip saddr limit rate over {RATE}/second burst {BURST} packets }} drop
                    }}
                }}"
            ))?;
            Attached::Ref(PASS, link)
        }
        Contender::Iptables => {
            let link = refs.attach(PASS, ns, dev)?;
            add_hashlimit(ns)?;
            Attached::Ref(PASS, link)
        }
        Contender::Lru | Contender::LruPerCpu => {
            let kind = contender.lru_kind().expect("an LRU contender");
            let lru = refs.lru(kind, TRACKED, Gcra::new(RATE, BURST))?;
            let link = in_netns(ns, || lru.program.attach(dev, XdpMode::Driver))
                .with_context(|| format!("attaching the {} contender", kind.tag()))?;
            Attached::Lru(kind, link)
        }
    })
}

/// nftables' rule set for `contender`'s two levels on `dev`: per source, then the global
/// limit (`NftAggregate`), or the other way round (`NftAggregateFirst`).
fn nft_aggregate(contender: Contender, dev: &str) -> String {
    // The same two levels: every source its own bucket, and everything but the test
    // bed's own prefix one shared bucket. nftables has no refund: a packet the second
    // level drops has spent a token of the first (the flood's sources are new anyway).
    let per_source = format!(
        "update @sources {{ ip saddr limit rate over {RATE}/second burst {BURST} packets }} drop"
    );
    let global = format!(
        "ip saddr != {KNOWN_NET} limit rate over {AGGREGATE_RATE}/second burst {AGGREGATE_BURST} packets drop"
    );
    let (first, second) = if contender == Contender::NftAggregate {
        (per_source, global)
    } else {
        (global, per_source)
    };
    format!(
        "table netdev rlbench {{
                    set sources {{
                        type ipv4_addr
                        size {TRACKED}
                        flags dynamic,timeout
                        timeout 60s
                    }}
                    chain ingress {{
                        type filter hook ingress device \"{dev}\" priority filter; policy accept;
                        {first}
                        {second}
                    }}
                }}"
    )
}

/// iptables' per-source limit: a hashlimit rule in `ns`'s raw PREROUTING chain.
fn add_hashlimit(ns: &Netns) -> Result<()> {
    let (rate, burst, max) = (
        format!("{RATE}/sec"),
        BURST.to_string(),
        TRACKED.to_string(),
    );
    ns.run(&[
        "iptables",
        "-t",
        "raw",
        "-A",
        "PREROUTING",
        "-m",
        "hashlimit",
        "--hashlimit-name",
        "rlbench",
        "--hashlimit-mode",
        "srcip",
        "--hashlimit-above",
        &rate,
        "--hashlimit-burst",
        &burst,
        "--hashlimit-htable-size",
        "65536",
        "--hashlimit-htable-max",
        &max,
        "--hashlimit-htable-expire",
        "60000",
        "-j",
        "DROP",
    ])
    .context("adding the iptables hashlimit rule")?;
    Ok(())
}

pub(super) fn teardown(
    refs: &mut Refs,
    bed: &Testbed,
    limiter: &mut Limiter,
    contender: Contender,
    attached: Attached,
) -> Result<()> {
    match contender {
        Contender::Nft | Contender::NftAggregate | Contender::NftAggregateFirst => {
            bed.rx
                .run(&["nft", "delete", "table", "netdev", "rlbench"])?;
        }
        Contender::Iptables => {
            bed.rx.run(&["iptables", "-t", "raw", "-F", "PREROUTING"])?;
        }
        _ => {}
    }
    match attached {
        Attached::Ref(name, link) => refs.detach(name, link)?,
        Attached::Limiter => {
            limiter.tdp.dataplane().detach(&bed.rx_if)?;
        }
        Attached::Lru(kind, link) => {
            let lru = refs.lru(kind, TRACKED, Gcra::new(RATE, BURST))?;
            lru.program
                .detach(link)
                .context("detaching the LRU contender")?;
        }
    }
    if contender.layered() {
        limiter.install(&Config::parse(E2E_RULES, "bench.toml")?.rules)?;
    }
    Ok(())
}

/// A contender's own count, read before and after the runs.
#[derive(Clone, Copy)]
pub(super) enum Count {
    /// Packets it dropped.
    Dropped(u64),
    /// Packets it let through.
    Passed(u64),
}

/// What the contender itself counted.
pub(super) fn contender_count(
    bed: &Testbed,
    limiter: &Limiter,
    contender: Contender,
) -> Result<Option<Count>> {
    Ok(match contender {
        Contender::Limiter | Contender::LimiterAggregate | Contender::LimiterAggregateFirst => {
            let id = limiter.id(contender.rule())?;
            let s = limiter.tdp.rule(id);
            Some(Count::Dropped(s.pkts[verdict::DROPPED_RATE]))
        }
        Contender::Nft | Contender::NftAggregate | Contender::NftAggregateFirst => {
            // Listing any nft object makes nft fetch every set element (a million, tens of
            // seconds), so count what nft let through instead: IPv4 packets that reached the IP
            // layer (`Ip: InReceives`), and report the rest of what the veth handled as dropped.
            Some(Count::Passed(ip_in_receives(bed)?))
        }
        Contender::Iptables => {
            let out = bed.rx.run(&[
                "iptables",
                "-t",
                "raw",
                "-L",
                "PREROUTING",
                "-v",
                "-x",
                "-n",
            ])?;
            // The rule's line: "pkts bytes target ..."; the header lines do not start with a number.
            Some(Count::Dropped(
                out.lines()
                    .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
                    .sum(),
            ))
        }
        Contender::DropAll
        | Contender::DropAllLayered
        | Contender::ReadDrop
        | Contender::Pass
        | Contender::Lru
        | Contender::LruPerCpu => None,
    })
}

/// `Ip: InReceives` of the receiving namespace (/proc/net/snmp).
fn ip_in_receives(bed: &Testbed) -> Result<u64> {
    let snmp = bed.rx.run(&["cat", "/proc/net/snmp"])?;
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (ip.next().unwrap_or(""), ip.next().unwrap_or(""));
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "InReceives")
        .and_then(|(_, v)| v.parse().ok())
        .context("no Ip: InReceives in /proc/net/snmp")
}
