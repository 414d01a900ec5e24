//! The cluster budget against the number of hosts: N real agents (2, 4, 8, 16; `--quick`: 2 and
//! 4) in their own namespaces share one `scope = "cluster"` rule (1,000 pps, burst 500, sync
//! 100 ms) while one source floods at 4x the budget (see `ratelimit_testbed::cluster_net`). Per
//! N: what the cluster admits over the budget for a 95/5 split and an even split (each measured
//! over its last 6 s), the time until every 1 s window is back within 10% of the budget after the
//! change to each, gossip bytes per second per host and agent CPU per host over both phases.
//! Ratios are against the 2-host cluster of the same run. For 4 hosts the run goes on through a
//! partition (h0's gossip link down) and its heal, and `cluster.svg` charts the admitted rate over
//! the whole run; `cluster_gossip.svg` charts gossip bytes per host against N.
//!
//! Then, on the same agents, the same source sends bursts back to back instead
//! (`ratelimit_testbed::bursty`), as real clients do: an even phase (each host a burst of its
//! share of 4x the budget every 200 ms, the hosts' phases spread evenly over the period) and a
//! 95/5 one (h0 95% of it, h1 5%, half a period apart), [`BURSTY_SETTLE`] s unmeasured then
//! [`BURSTY_MEASURE`] s measured each. Every datagram carries its sequence number, so what the
//! cluster admitted of the datagrams sent in the measured window is counted exactly and compared
//! with what one bucket (rate 1,000, burst 500) would have admitted of the very same datagrams
//! (`one_bucket` over their recorded send times), and with the budget.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use plotters::prelude::*;
use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::bursty::{one_bucket, Plan};
use ratelimit_testbed::cluster_net::{
    cluster_counter, cpu_time, stalls, status, ClusterNet, Convergence, Samples, Split, Stall,
    FLOOD,
};
use serde_json::json;

use crate::{
    report::{Figure, Report},
    session::{announce, check_interrupted, Options},
};

const RATE: u64 = 1000;
const BURST: u64 = 500;
const SYNC_MS: u64 = 100;
const FLOOD_PPS: f64 = 4000.0;
/// Seconds of each phase; the first is a warm-up (every host's first burst and its payback,
/// `hosts x burst / rate` and what the hosts admitted before hearing of each other), at least
/// [`WARMUP`] and twice that payback plus 4 s.
const WARMUP: f64 = 8.0;
const PHASE: f64 = 8.0;
/// Seconds into a phase after which it is measured.
const SETTLE: f64 = 2.0;
/// The host count whose run also goes through a partition and its heal, for the chart.
const CHART_HOSTS: usize = 4;
/// Seconds between one host's bursts in the bursty phases.
const BURST_PERIOD: f64 = 0.2;
/// Seconds at the start of each bursty phase not measured: the change from the smooth flood (or
/// the previous split) and the shares settling on the new demand.
const BURSTY_SETTLE: f64 = 3.0;
/// Seconds of each bursty phase measured after [`BURSTY_SETTLE`].
const BURSTY_MEASURE: f64 = 6.0;

/// What one bursty phase measured, over the datagrams sent in its measured window.
struct Bursty {
    name: &'static str,
    /// Seconds after the bursty sender's start: the phase's start, the measured window's start,
    /// the phase's end.
    t0: f64,
    from: f64,
    t1: f64,
    /// Datagrams sent in the measured window, per host.
    sent: Vec<u64>,
    /// Of those, what the hosts' receivers got, per host.
    admitted: Vec<u64>,
    /// Of those, what one bucket would have admitted, per host.
    reference: Vec<u64>,
}

impl Bursty {
    fn admitted_total(&self) -> u64 {
        self.admitted.iter().sum()
    }

    fn reference_total(&self) -> u64 {
        self.reference.iter().sum()
    }
}

/// What the bursty sender did, over both bursty phases.
struct BurstyRun {
    phases: Vec<Bursty>,
    /// Datagrams the receivers' sockets dropped (a full buffer) while the bursts ran, per host:
    /// counted as not admitted although the limiter passed them.
    socket_drops: Vec<u64>,
    /// Sends refused for want of buffer space (not sent, not counted anywhere).
    send_errors: u64,
    /// Datagrams sent to each host over both phases, and what each host's program saw of the
    /// source meanwhile (passed + dropped): a datagram lost on the way, before the limiter,
    /// counts as not admitted although no limiter dropped it.
    sent_all: Vec<u64>,
    seen: Vec<u64>,
    /// Bursts started 30 ms or more late.
    late: usize,
    /// The longest burst, first datagram to last, ms.
    longest_burst_ms: f64,
}

/// What one cluster size measured.
struct Run {
    hosts: usize,
    /// (phase name, start, end, admitted pps over the measured part, convergence).
    phases: Vec<(String, f64, f64, f64, Convergence)>,
    /// When the sender or a receiver did not run (see `Stall`).
    stalls: Vec<Stall>,
    gossip_bps: f64,
    cpu_pct: f64,
    /// The admitted rate over 0.5 s windows, for the chart.
    timeline: Vec<(f64, f64)>,
    bursty: BurstyRun,
}

/// Runs the part and adds its figures to `report`; writes the charts next to `json`.
pub fn run(report: &mut Report, opts: &Options, json: &Path) -> Result<()> {
    let sizes: &[usize] = if opts.quick { &[2, 4] } else { &[2, 4, 8, 16] };
    let mut runs = Vec::new();
    for &n in sizes {
        check_interrupted()?;
        announce(&format!("cluster: {n} agents"));
        runs.push(one(n).with_context(|| format!("cluster of {n}"))?);
    }
    for r in &runs {
        r.phase_figures(report);
        r.bursty_figures(report);
        r.host_figures(report);
    }
    if let Some(r) = runs.iter().find(|r| r.hosts == CHART_HOSTS) {
        let svg = json.with_file_name("cluster.svg");
        timeline_chart(r, &svg)?;
        eprintln!("==> bench: chart written to {}", svg.display());
    }
    let svg = json.with_file_name("cluster_gossip.svg");
    gossip_chart(&runs, &svg)?;
    eprintln!("==> bench: chart written to {}", svg.display());
    Ok(())
}

/// The budget, packets a second.
fn budget() -> f64 {
    f64::from(u32::try_from(RATE).unwrap_or(1000))
}

impl Run {
    /// The key of this figure at 2 hosts, against which it is shown (none for 2 hosts).
    fn base(&self, what: &str) -> Option<String> {
        (self.hosts != 2).then(|| format!("cluster.n2.{what}"))
    }

    /// Each phase's admitted rate against the budget and how soon it converged.
    fn phase_figures(&self, report: &mut Report) {
        let n = self.hosts;
        for (name, t0, t1, admitted, conv) in &self.phases {
            let tag = name.replace(['/', ' '], "_");
            report.add(Figure {
                key: format!("cluster.n{n}.{tag}.admitted"),
                section: "cluster",
                label: format!("{n} hosts, {name}: admitted / budget"),
                unit: "x",
                runs: vec![admitted / budget()],
                baseline: self.base(&format!("{tag}.admitted")),
                detail: json!({ "phase_s": [t0, t1], "measured_from_s": t0 + SETTLE }),
            });
            report.add(Figure {
                key: format!("cluster.n{n}.{tag}.converge"),
                section: "cluster",
                label: format!(
                    "{n} hosts, {name}: s until every 1 s window is within 10% (-1: never)"
                ),
                unit: "s",
                runs: vec![conv.after.unwrap_or(-1.0)],
                // Not against 2 hosts: that one is often 0 s (never outside 10%), and a ratio
                // to 0 says nothing; the yardstick is 3 sync intervals, 0.3 s.
                baseline: None,
                detail: json!({
                    "sync_intervals": conv.after.map(|c| c * 1000.0 / 100.0),
                    // Windows outside 10% read from a sample taken in a stall of the bench's
                    // own threads (see `Samples::convergence`), not held against it.
                    "excused_windows": conv.excused,
                    "stalls": self.stalls.iter().map(|s| json!({ "who": s.who.to_string(), "at_s": s.at, "s": s.secs })).collect::<Vec<_>>(),
                }),
            });
        }
    }

    /// Each bursty phase's admitted datagrams against one bucket's of the same datagrams and
    /// against the budget.
    fn bursty_figures(&self, report: &mut Report) {
        let n = self.hosts;
        let r = &self.bursty;
        for b in &r.phases {
            let tag = format!("bursty_{}", b.name.replace(['/', ' '], "_"));
            #[expect(clippy::cast_precision_loss, reason = "small counts")]
            let (cluster, reference) = (b.admitted_total() as f64, b.reference_total() as f64);
            let detail = json!({
                "phase_s": [b.t0, b.t1],
                "measured_s": [b.from, b.t1],
                "sent_per_host": b.sent,
                "admitted_per_host": b.admitted,
                "one_bucket_per_host": b.reference,
                "receiver_socket_drops": r.socket_drops,
                "send_errors": r.send_errors,
                "sent_per_host_both_phases": r.sent_all,
                "seen_by_the_programs_both_phases": r.seen,
                "bursts_late_30ms": r.late,
                "longest_burst_ms": r.longest_burst_ms,
            });
            report.add(Figure {
                key: format!("cluster.n{n}.{tag}.vs_one_bucket"),
                section: "cluster",
                label: format!(
                    "{n} hosts, bursty {}: admitted / one bucket's of the same datagrams",
                    b.name
                ),
                unit: "x",
                runs: vec![cluster / reference.max(1.0)],
                baseline: self.base(&format!("{tag}.vs_one_bucket")),
                detail: detail.clone(),
            });
            report.add(Figure {
                key: format!("cluster.n{n}.{tag}.admitted"),
                section: "cluster",
                label: format!("{n} hosts, bursty {}: admitted / budget", b.name),
                unit: "x",
                runs: vec![cluster / (budget() * (b.t1 - b.from))],
                baseline: self.base(&format!("{tag}.admitted")),
                detail,
            });
        }
    }

    /// Gossip sent and agent CPU, per host.
    fn host_figures(&self, report: &mut Report) {
        let n = self.hosts;
        report.add(Figure {
            key: format!("cluster.n{n}.gossip"),
            section: "cluster",
            label: format!("{n} hosts: gossip sent per host"),
            unit: "B/s",
            runs: vec![self.gossip_bps],
            baseline: self.base("gossip"),
            detail: json!({}),
        });
        report.add(Figure {
            key: format!("cluster.n{n}.cpu"),
            section: "cluster",
            label: format!("{n} hosts: agent CPU per host"),
            unit: "%",
            runs: vec![self.cpu_pct],
            baseline: self.base("cpu"),
            detail: json!({ "binary": ratelimit_testbed::agent_binary().display().to_string() }),
        });
    }
}

/// One cluster size: its phases planned, sent and counted in order, then the bursty phases on
/// the same agents.
fn one(n: usize) -> Result<Run> {
    let net = ClusterNet::new(&format!("rl-bc{n}"), n)?;
    let agents = net.start_agents(RATE, BURST, SYNC_MS, Duration::from_secs(60 + 5 * n as u64))?;
    let receivers = net.receivers()?;
    let phases = phases(n);
    let (bounds, schedule) = timed(n, &phases);
    let t = bounds.last().map_or(0.0, |b| b.1);
    let start = Instant::now();
    let sender = net.flood(schedule, start)?;
    let mut samples = Samples::default();
    let mut before = None;
    let mut after = None;
    let every = Duration::from_millis(50);
    for (i, ((_, _, link), &(_, t1))) in phases.iter().zip(&bounds).enumerate() {
        if let Some(up) = link {
            net.set_gossip(0, *up)?;
        }
        if i == 1 {
            before = Some(usage(&agents)?);
        }
        samples.take_until(&receivers, start, t1, every);
        if i == 2 {
            after = Some(usage(&agents)?);
        }
    }
    let sent = sender
        .join()
        .map_err(|_| anyhow!("the flood sender panicked"))?;
    let stalls = stalls(&sent, &receivers, start);
    let (gossip_bps, cpu_pct) = per_host(
        n,
        &before.expect("phase 1 ran"),
        &after.expect("phase 2 ran"),
    );
    let mut measured = Vec::new();
    for (i, ((name, _, _), &(t0, t1))) in phases.iter().zip(&bounds).enumerate() {
        if i == 0 {
            continue;
        }
        let want = if *name == "h0 cut off (95/5)" {
            // Each side of the partition enforces the whole budget (fail open): h0 admits the
            // budget, the others what h1 is sent (5% of the flood), under theirs.
            budget() + budget().min(0.05 * FLOOD_PPS)
        } else {
            budget()
        };
        measured.push((
            (*name).to_string(),
            t0,
            t1,
            samples.rate(t0 + SETTLE, t1),
            samples.convergence(t0, t1, 1.0, want, 0.10, &stalls, &[]),
        ));
    }
    let timeline = samples.trailing_rates(0.0, t, 0.5);
    check_interrupted()?;
    let bursty = bursty(&net, &agents, &receivers, n)?;
    drop(receivers);
    for a in agents {
        let _ = a.stop();
    }
    drop(net);
    Ok(Run {
        hosts: n,
        phases: measured,
        stalls,
        gossip_bps,
        cpu_pct,
        timeline,
        bursty,
    })
}

/// A phase of the flood: its name, the weights of the hosts' shares, and h0's gossip link up or
/// down at its start (`None`: as it was).
type Phase = (&'static str, Vec<f64>, Option<bool>);

/// The phases of `n` hosts: a warm-up, 95/5, even; for [`CHART_HOSTS`] also h0 cut off and
/// healed, both 95/5.
fn phases(n: usize) -> Vec<Phase> {
    let even = vec![1.0; n];
    let mut skew = vec![0.0; n];
    skew[0] = 95.0;
    skew[1] = 5.0;
    let mut phases: Vec<Phase> = vec![
        ("warm-up (even)", even.clone(), None),
        ("95/5", skew.clone(), None),
        ("even", even, None),
    ];
    if n == CHART_HOSTS {
        phases.push(("h0 cut off (95/5)", skew.clone(), Some(false)));
        phases.push(("healed (95/5)", skew, Some(true)));
    }
    phases
}

/// Each phase's (start, end) in seconds from the flood's start, and the flood's schedule: the
/// warm-up long enough to pay back `n` bursts twice over, the others [`PHASE`] each.
fn timed(n: usize, phases: &[Phase]) -> (Vec<(f64, f64)>, Vec<Split>) {
    let mut schedule = Vec::new();
    let mut bounds = Vec::new();
    let mut t = 0.0;
    for (i, (_, w, _)) in phases.iter().enumerate() {
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let payback = (n as u64 * BURST) as f64 / RATE as f64;
        let secs = if i == 0 {
            WARMUP.max(2.0 * payback + 4.0)
        } else {
            PHASE
        };
        bounds.push((t, t + secs));
        t += secs;
        schedule.push(Split {
            end: t,
            pps: FLOOD_PPS,
            weights: w.clone(),
        });
    }
    (bounds, schedule)
}

/// Gossip bytes a second and agent CPU (% of a core), per host, between two [`usage`] reads.
fn per_host(
    n: usize,
    before: &(Instant, Vec<u64>, Vec<Duration>),
    after: &(Instant, Vec<u64>, Vec<Duration>),
) -> (f64, f64) {
    let (b, a) = (before, after);
    let secs = a.0.duration_since(b.0).as_secs_f64();
    #[expect(clippy::cast_precision_loss, reason = "byte counts")]
    let gossip_bps =
        a.1.iter()
            .zip(&b.1)
            .map(|(x, y)| (x - y) as f64)
            .sum::<f64>()
            / secs
            / n as f64;
    #[expect(clippy::cast_precision_loss, reason = "host count")]
    let cpu_pct =
        a.2.iter()
            .zip(&b.2)
            .map(|(x, y)| x.saturating_sub(*y).as_secs_f64())
            .sum::<f64>()
            / secs
            / n as f64
            * 100.0;
    (gossip_bps, cpu_pct)
}

/// The bursty phases on `net`'s running agents: sends the plan (see the module's doc), waits for
/// the last datagrams, and counts what the cluster and one bucket admitted of each phase's
/// measured window.
fn bursty(
    net: &ClusterNet,
    agents: &[ratelimit_testbed::AgentProcess],
    receivers: &[ratelimit_testbed::Receiver],
    n: usize,
) -> Result<BurstyRun> {
    let len = BURSTY_SETTLE + BURSTY_MEASURE;
    let drops_before = socket_drops(receivers)?;
    let seen_before = seen(agents);
    let start = Instant::now();
    let log = net
        .bursts_from(FLOOD, bursty_plan(n, len), start)?
        .join()
        .map_err(|_| anyhow!("the burst sender panicked"))?;
    for r in receivers {
        r.wait_idle(Duration::from_millis(200), Duration::from_secs(3));
    }
    let since = |now: Vec<u64>, before: &[u64]| -> Vec<u64> {
        now.iter()
            .zip(before)
            .map(|(a, b)| a.saturating_sub(*b))
            .collect()
    };
    let socket_drops = since(socket_drops(receivers)?, &drops_before);
    let seen = since(seen(agents), &seen_before);
    let admitted = log.admitted(receivers);
    let times: Vec<f64> = log.sent.iter().map(|d| d.t).collect();
    #[expect(clippy::cast_precision_loss, reason = "small settings")]
    let reference = one_bucket(&times, RATE as f64, BURST as f64);
    let phases = [("even", 0.0), ("95/5", len)]
        .into_iter()
        .map(|(name, t0)| {
            let (from, t1) = (t0 + BURSTY_SETTLE, t0 + len);
            Bursty {
                name,
                t0,
                from,
                t1,
                sent: log.per_host(n, from, t1),
                admitted: log.count_per_host(&admitted, n, from, t1),
                reference: log.count_per_host(&reference, n, from, t1),
            }
        })
        .collect::<Vec<Bursty>>();
    for b in &phases {
        eprintln!(
            "==> bench: cluster of {n}, bursty {}: datagrams sent {:.0}-{:.0} s {:?}, admitted {:?} \
             ({}), one bucket {:?} ({})",
            b.name,
            b.from,
            b.t1,
            b.sent,
            b.admitted,
            b.admitted_total(),
            b.reference,
            b.reference_total()
        );
    }
    Ok(BurstyRun {
        phases,
        socket_drops,
        send_errors: log.errors,
        sent_all: log.per_host(n, 0.0, f64::MAX),
        seen,
        late: log.late.len(),
        longest_burst_ms: log.longest_burst * 1000.0,
    })
}

/// The bursts of `n` hosts, phases of `len` seconds: even (every host its share, the hosts'
/// bursts spread over the period), then 95/5 (h0 and h1, half a period apart).
fn bursty_plan(n: usize, len: f64) -> Plan {
    #[expect(clippy::cast_precision_loss, reason = "host count")]
    let nf = n as f64;
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "bursts of at most a few hundred"
    )]
    let size = |share: f64| (FLOOD_PPS * BURST_PERIOD * share).round() as u32;
    let mut plan = Plan::default();
    for h in 0..n {
        #[expect(clippy::cast_precision_loss, reason = "host count")]
        let offset = BURST_PERIOD * h as f64 / nf;
        plan = plan.periodic(h, size(1.0 / nf), BURST_PERIOD, offset, len, |_| true);
    }
    plan.periodic(0, size(0.95), BURST_PERIOD, len, 2.0 * len, |_| true)
        .periodic(
            1,
            size(0.05),
            BURST_PERIOD,
            len + BURST_PERIOD / 2.0,
            2.0 * len,
            |_| true,
        )
}

/// Datagrams each receiver's socket dropped so far.
fn socket_drops(receivers: &[ratelimit_testbed::Receiver]) -> Result<Vec<u64>> {
    receivers
        .iter()
        .map(ratelimit_testbed::Receiver::socket_drops)
        .collect()
}

/// Packets of the flood's rule each agent's program has seen so far (passed or dropped).
fn seen(agents: &[ratelimit_testbed::AgentProcess]) -> Vec<u64> {
    agents
        .iter()
        .map(|a| {
            let s = a.stats();
            ["passed", "dropped_rate"]
                .iter()
                .map(|v| rule_packets(&s, "cluster-flood", v))
                .sum()
        })
        .collect()
}

/// (when, bytes sent by each agent's gossip, CPU time of each agent).
fn usage(agents: &[ratelimit_testbed::AgentProcess]) -> Result<(Instant, Vec<u64>, Vec<Duration>)> {
    let mut bytes = Vec::new();
    let mut cpu = Vec::new();
    for a in agents {
        bytes.push(cluster_counter(&status(a)?, "bytes_out"));
        cpu.push(cpu_time(a.pid().ok_or_else(|| anyhow!("agent exited"))?)?);
    }
    Ok((Instant::now(), bytes, cpu))
}

fn timeline_chart(r: &Run, path: &Path) -> Result<()> {
    let top = r.timeline.iter().map(|p| p.1).fold(2500.0, f64::max) * 1.1;
    let end = r.timeline.last().map_or(40.0, |p| p.0);
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "{} hosts, one source at 4x a 1,000 pps cluster budget: admitted pps (0.5 s windows)",
                    r.hosts
                ),
                ("sans-serif", 18),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..end, 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the flood started")
            .y_desc("packets per second admitted, all hosts")
            .draw()?;
        let grey = RGBColor(150, 150, 150);
        chart.draw_series(LineSeries::new(
            vec![(0.0, 1000.0), (end, 1000.0)],
            grey.stroke_width(1),
        ))?;
        for (name, t0, _, _, _) in &r.phases {
            let x = *t0;
            chart.draw_series(LineSeries::new(
                vec![(x, 0.0), (x, top)],
                grey.stroke_width(1),
            ))?;
            chart.draw_series(std::iter::once(Text::new(
                name.clone(),
                (x + 0.2, top * 0.95),
                ("sans-serif", 12),
            )))?;
        }
        let blue = RGBColor(31, 90, 180);
        chart.draw_series(LineSeries::new(
            r.timeline.iter().copied(),
            blue.stroke_width(2),
        ))?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}

fn gossip_chart(runs: &[Run], path: &Path) -> Result<()> {
    #[expect(clippy::cast_precision_loss, reason = "host counts")]
    let points: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (r.hosts as f64, r.gossip_bps / 1000.0))
        .collect();
    let top = points.iter().map(|p| p.1).fold(10.0, f64::max) * 1.2;
    let right = points.iter().map(|p| p.0).fold(2.0, f64::max) + 1.0;
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (760, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Gossip sent per host against cluster size (sync 100 ms)",
                ("sans-serif", 18),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..right, 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("hosts in the cluster")
            .y_desc("KB/s sent per host")
            .draw()?;
        let red = RGBColor(200, 50, 40);
        chart.draw_series(LineSeries::new(points.iter().copied(), red.stroke_width(2)))?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, red.filled())))?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}
