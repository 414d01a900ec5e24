//! What the demo prints: a table row per source every second, the agent's counters for the rule,
//! and the summary. Everything comes from a [`Sample`]: the receiver's per-source counts, the
//! clients' sent counters and `ratelimit stats --json` from the agent's pinned maps.

use std::{
    path::Path,
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use ratelimit_testbed::{agent_binary, Receiver};
use serde_json::Value;

use crate::traffic::{Client, Totals};

/// The rule the demo's sources fall under, as the agent's config sets it.
pub struct Limit {
    /// Rule name.
    pub rule: String,
    /// Packets per second per source.
    pub rate: u64,
    /// Burst, packets.
    pub burst: u64,
}

/// The agent's counters for the demo's rule.
pub struct AgentCounters {
    passed: u64,
    dropped_rate: u64,
    buckets: u64,
}

/// Everything measured at one moment.
pub struct Sample {
    at: Instant,
    rule: String,
    /// Per client: sent, received.
    counts: Vec<(u64, u64)>,
    agent: Result<AgentCounters>,
}

impl Sample {
    /// Reads the receiver, then the clients (so that sent >= received, see [`Client::sent`]), then
    /// the agent's counters.
    pub fn take(clients: &[&Client], receiver: &Receiver, pin_path: &Path, rule: &str) -> Sample {
        let received = receiver.counts();
        let counts = clients
            .iter()
            .map(|c| {
                let got = received.get(&c.addr).copied().unwrap_or(0);
                (c.sent(), got)
            })
            .collect();
        Sample {
            at: Instant::now(),
            rule: rule.to_owned(),
            counts,
            agent: agent_counters(pin_path, rule),
        }
    }
}

/// `ratelimit stats --json --pin-path P`: the agent's counters for rule `rule`, from its maps.
fn agent_counters(pin_path: &Path, rule: &str) -> Result<AgentCounters> {
    let out = Command::new(agent_binary())
        .args(["stats", "--json", "--pin-path"])
        .arg(pin_path)
        .output()
        .context("running `ratelimit stats`")?;
    if !out.status.success() {
        bail!(
            "`ratelimit stats --json --pin-path {}` failed ({}): {}",
            pin_path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stats: Value =
        serde_json::from_slice(&out.stdout).context("parsing `ratelimit stats --json`")?;
    let counters = stats["rules"]
        .as_array()
        .and_then(|rules| rules.iter().find(|r| r["name"] == rule))
        .map(|r| &r["packets"])
        .with_context(|| format!("no rule {rule:?} in `ratelimit stats --json`: {stats}"))?;
    let count = |v: &Value, what: &str| {
        v.as_u64()
            .with_context(|| format!("no {what} in `ratelimit stats --json`: {stats}"))
    };
    Ok(AgentCounters {
        passed: count(&counters["passed"], "packets.passed")?,
        dropped_rate: count(&counters["dropped_rate"], "packets.dropped_rate")?,
        buckets: count(&stats["buckets"]["tracked"], "buckets.tracked")?,
    })
}

/// Prints a row per client and one for the agent every second until the clients are done (or the
/// run is interrupted); returns the last sample printed, if any.
pub fn table(
    clients: &[&Client],
    receiver: &Receiver,
    pin_path: &Path,
    rule: &str,
    start: Instant,
    interrupted: &AtomicBool,
) -> Option<Sample> {
    println!(
        "{:>7}  {:<7} {:<12} {:>10} {:>10} {:>10} {:>9}",
        "time", "source", "", "sent", "received", "dropped", "recv/s"
    );
    let mut previous: Option<Sample> = None;
    for tick in 1u64.. {
        let due = start + Duration::from_secs(tick);
        loop {
            if interrupted.load(Ordering::SeqCst) || clients.iter().all(|c| c.done()) {
                return previous;
            }
            let now = Instant::now();
            if now >= due {
                break;
            }
            thread::sleep((due - now).min(Duration::from_millis(50)));
        }
        let sample = Sample::take(clients, receiver, pin_path, rule);
        print_rows(clients, &sample, previous.as_ref(), start, false);
        previous = Some(sample);
    }
    previous
}

/// Prints one row per client and the agent's row. `before` (the previous sample) gives the
/// receive rate; without it, the rate is over the time since `start`.
pub fn print_rows(
    clients: &[&Client],
    now: &Sample,
    before: Option<&Sample>,
    start: Instant,
    end: bool,
) {
    let (since, before_counts) = match before {
        Some(b) => (b.at, b.counts.clone()),
        None => (start, vec![(0, 0); clients.len()]),
    };
    let secs = (now.at - since).as_secs_f64();
    for (i, (client, &(sent, got))) in clients.iter().zip(&now.counts).enumerate() {
        let time = match (i, end) {
            (0, false) => format!("{:.1} s", (now.at - start).as_secs_f64()),
            (0, true) => "end".to_owned(),
            _ => String::new(),
        };
        // The end row comes a fraction of a second after the last: no rate worth showing.
        let rate = if end {
            String::new()
        } else {
            rate(got.saturating_sub(before_counts[i].1), secs).to_string()
        };
        let row = format!(
            "{time:>7}  {:<7} {:<12} {sent:>10} {got:>10} {:>10} {rate:>9}",
            client.label,
            client.addr,
            sent.saturating_sub(got),
        );
        println!("{}", row.trim_end());
    }
    match &now.agent {
        Ok(a) => println!(
            "{:>7}  {:<7} rule {:?}: passed {}, dropped_rate {}, buckets tracked {}",
            "", "agent", now.rule, a.passed, a.dropped_rate, a.buckets
        ),
        Err(e) => println!("{:>7}  {:<7} counters unavailable: {e:#}", "", "agent"),
    }
}

#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "packet counts far below 2^52; the rate is rounded and not negative"
)]
fn rate(packets: u64, secs: f64) -> u64 {
    if secs <= 0.0 {
        return 0;
    }
    (packets as f64 / secs).round() as u64
}

/// Prints the summary: what each client sent and got, against the limit the rule implies for the
/// flood's measured duration, and the agent's own account.
#[allow(clippy::cast_precision_loss, reason = "packet counts far below 2^52")]
pub fn summary(
    clients: &[&Client; 2],
    totals: &[Totals; 2],
    end: &Sample,
    limit: &Limit,
    socket_drops: Option<u64>,
    interrupted: bool,
) {
    let [flood, polite] = clients;
    let [(flood_sent, admitted), (polite_sent, polite_got)] = [end.counts[0], end.counts[1]];
    let t = totals[0].duration().as_secs_f64();
    // What the bucket lets through in `t`: `burst` at once, then `rate` per second. `t` is timed
    // at the sender, which the kernel's clock sees shifted by microseconds: a packet either way.
    let allowed = limit.burst as f64 + limit.rate as f64 * t;
    println!();
    println!(
        "Summary{} (all measured; the limit is burst + rate x the flood's duration):",
        if interrupted {
            ", interrupted early"
        } else {
            ""
        }
    );
    println!(
        "  {:<6} {}: sent {flood_sent} ({:.0} pps), admitted {admitted} (limit {} + {}/s x {t:.2} s = {:.0}; {:.1}%), dropped {}",
        flood.label,
        flood.addr,
        totals[0].achieved_pps(),
        limit.burst,
        limit.rate,
        allowed,
        if allowed > 0.0 { admitted as f64 * 100.0 / allowed } else { 0.0 },
        flood_sent.saturating_sub(admitted),
    );
    println!(
        "  {:<6} {}: sent {polite_sent} ({:.0} pps), received {polite_got}, lost {}",
        polite.label,
        polite.addr,
        totals[1].achieved_pps(),
        polite_sent.saturating_sub(polite_got),
    );
    match &end.agent {
        Ok(a) => println!(
            "  {:<6} rule {:?}: passed {} (the receiver got {}), dropped_rate {} (flood sent - admitted = {})",
            "agent",
            limit.rule,
            a.passed,
            admitted + polite_got,
            a.dropped_rate,
            flood_sent.saturating_sub(admitted),
        ),
        Err(e) => println!("  {:<6} counters unavailable: {e:#}", "agent"),
    }
    if let Some(drops) = socket_drops.filter(|&d| d > 0) {
        println!("  note: the receiving socket overflowed and dropped {drops} datagrams itself (after the limiter)");
    }
    for (client, t) in clients.iter().zip(totals) {
        if t.skipped > 0 || t.errors > 0 {
            println!(
                "  note: the {} client fell behind (machine busy): {} slots skipped, {} sends refused",
                client.label, t.skipped, t.errors
            );
        }
    }
}
