//! What was measured, printed: the admitted rate per phase and per host, the time to converge
//! after each change, the gossip per host; `RL_CLUSTER_TRACE=1` adds the rate second by second.

use crate::{
    counter, Figures, Run, Sample, BURST, FLOOD_PPS, PHASES, RATE, SAMPLE, SYNC_MS, TOLERANCE,
};

/// Admitted packets per second from `hosts` between `t1` and `t2` (the samples nearest inside).
fn rate(samples: &[Sample], hosts: &[usize], t1: f64, t2: f64) -> f64 {
    let first = samples
        .iter()
        .find(|s| s.t >= t1)
        .expect("a sample after t1");
    let last = samples
        .iter()
        .rev()
        .find(|s| s.t <= t2)
        .expect("a sample before t2");
    let sum = |s: &Sample| hosts.iter().map(|&h| s.flood[h]).sum::<u64>();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let admitted = (sum(last) - sum(first)) as f64;
    admitted / (last.t - first.t)
}

/// Seconds after `t0` (a change) until the cluster's admitted rate over the last second is first
/// within the tolerance of `want` (0 if the change did not move it out; `None` if it never gets
/// there before `t1`). The windows reach back before `t0`, so right after a change they still
/// show the old regime. A first entry, not "stays within": over one second, the sampling (every
/// 250 ms) and the sync steps (every 100 ms) alone make the rate jitter by a few percent, and
/// whether it then stays is what each phase's measurement over several seconds asserts.
fn convergence(samples: &[Sample], t0: f64, t1: f64, want: f64) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.t >= t0 && s.t <= t1 && s.t >= 1.0)
        .find(|s| (rate(samples, &[0, 1, 2], s.t - 1.0, s.t) / want - 1.0).abs() <= TOLERANCE)
        .map(|s| (s.t - t0).max(0.0))
}

/// Prints the figures of every phase and returns them for the assertions: what h0..h3 admitted
/// over each phase's measured window (from its `settle` to its end), how long after each change
/// the cluster's rate was back within the tolerance, the gossip each host sent, the largest gap
/// between samples, the datagrams rejected as not authentic and the sync lag once healed.
pub(crate) fn print(run: &Run) -> Figures {
    let samples = &run.samples;
    println!("\nbudget {RATE} pps (burst {BURST}) per source, cluster-wide; flood {FLOOD_PPS} pps; sync {SYNC_MS} ms");
    let mut results = Vec::new();
    for (phase, &(t0, t1)) in PHASES.iter().zip(&run.phase_bounds) {
        let (m0, m1) = (t0 + phase.settle, t1);
        let per_host: Vec<f64> = (0..4).map(|h| rate(samples, &[h], m0, m1)).collect();
        let cluster = rate(samples, &[0, 1, 2], m0, m1);
        let conv = convergence(samples, t0, t1, phase.expect * RATE);
        println!(
            "{:<28} measured {:>4.1}-{:>4.1} s: cluster (h0+h1+h2) {:>6.0} pps = {:.3} x budget; h0 {:>5.0} h1 {:>5.0} h2 {:>5.0} | h3 (wrong key) {:>4.0}; \
             rate over the last second within 10% {}",
            phase.name,
            m0,
            m1,
            cluster,
            cluster / RATE,
            per_host[0],
            per_host[1],
            per_host[2],
            per_host[3],
            conv.map_or_else(|| "never".to_string(), |c| format!("{c:.2} s after the change")),
        );
        results.push((per_host, cluster, conv));
    }
    for (i, bytes) in run.gossip_bytes.iter().enumerate() {
        let line: Vec<String> = bytes
            .iter()
            .enumerate()
            .map(|(h, (agent, link))| format!("h{h} {agent:.0} B/s (link {link:.0} B/s)"))
            .collect();
        println!(
            "gossip sent during {:<28} {}",
            PHASES[i].name,
            line.join(", ")
        );
    }
    if std::env::var_os("RL_CLUSTER_TRACE").is_some() {
        for s in samples.iter().filter(|s| s.t >= 1.0) {
            println!(
                "t {:5.2} cluster rate over the last second {:6.0}",
                s.t,
                rate(samples, &[0, 1, 2], s.t - 1.0, s.t)
            );
        }
    }
    let gap = samples
        .windows(2)
        .map(|w| w[1].t - w[0].t)
        .fold(0.0, f64::max);
    println!("largest gap between samples: {gap:.2} s (every {SAMPLE:?} asked)");
    let healed = run.healed();
    let rejected: Vec<u64> = healed.iter().map(|s| counter(s, "rejected_auth")).collect();
    println!(
        "datagrams rejected as not authentic: h0 {} h1 {} h2 {} h3 {}",
        rejected[0], rejected[1], rejected[2], rejected[3]
    );
    println!(
        "sync lag (ms) at the end of the heal phase: {:?}",
        healed[..3]
            .iter()
            .map(|s| counter(s, "sync_lag_ms"))
            .collect::<Vec<_>>()
    );
    Figures { results, rejected }
}
