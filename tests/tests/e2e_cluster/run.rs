//! The five phases, played: one paced sender per destination for the whole run, following the
//! phases' split without a gap; the main thread acts at the phase boundaries, a sampler thread
//! reads the receivers every 250 ms.

use std::net::{IpAddr, SocketAddr};
use std::thread::{self, Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use ratelimit_testbed::cluster_net::{data_ip, ClusterHost};
use ratelimit_testbed::{bind_udp, late_rounds::unix_ms, AgentProcess, Netns, Receiver};
use serde_json::Value;

use crate::{
    counter, status, tx_bytes, Cluster, Phase, Run, Sample, FLOOD, FLOOD_PPS, INTRUDER_PPS,
    PAYLOAD, PHASES, POLITE, POLITE_PPS, PORT, SAMPLE,
};

/// Plays the phases in order, the flood and the polite source running from the first to the
/// end of the last, and waits for the receivers to go idle. What each phase asserts is read
/// from what this records: the samples, each phase's bounds, gossip and statuses at its end.
pub(crate) fn play_the_phases(cluster: &mut Cluster) -> Run {
    let Cluster {
        receivers,
        agents,
        down,
        net,
    } = cluster;
    let receivers = &*receivers;
    let ends: Vec<f64> = PHASES
        .iter()
        .scan(0.0, |t, p| {
            *t += p.secs;
            Some(*t)
        })
        .collect();
    let start = Instant::now();
    let start_unix_ms = unix_ms();
    let mut run = Run {
        start,
        start_unix_ms,
        samples: Vec::new(),
        phase_bounds: Vec::new(),
        gossip_bytes: Vec::new(),
        statuses_after: Vec::new(),
        readings: Vec::new(),
        polite_sent: Vec::new(),
        intruder_sent: 0,
    };
    thread::scope(|s| {
        let flood = spawn_flood(s, &net.tx, &ends, start);
        let polite = spawn_polite(s, &net.tx, &ends, start);
        let sampler = spawn_sampler(s, receivers, ends[ends.len() - 1], start);
        let mut begin = 0.0;
        for (phase, &end) in PHASES.iter().zip(&ends) {
            play_phase(phase, end, agents, &net.hosts, down, &mut run);
            run.phase_bounds.push((begin, end));
            begin = end;
        }
        run.samples = sampler.join().unwrap();
        let flood_sent: Vec<u64> = flood.into_iter().map(|h| h.join().unwrap()).collect();
        run.intruder_sent = flood_sent[3];
        run.polite_sent = polite.into_iter().map(|h| h.join().unwrap()).collect();
    });
    for r in receivers {
        r.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    }
    run
}

fn dst(i: usize) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(data_ip(i)), PORT)
}

/// The flood's senders: to h0..h2 following the phases' split of `FLOOD_PPS`, and to h3 (the
/// wrong key) `INTRUDER_PPS` throughout. Each returns the datagrams it sent.
fn spawn_flood<'scope>(
    s: &'scope Scope<'scope, '_>,
    tx: &Netns,
    ends: &[f64],
    start: Instant,
) -> Vec<ScopedJoinHandle<'scope, u64>> {
    let flood_ip = IpAddr::V4(FLOOD);
    let flood_sender = |i: usize, schedule: Vec<(f64, u64)>| {
        let sock = bind_udp(tx, SocketAddr::new(flood_ip, 0)).unwrap();
        s.spawn(move || paced(&sock, dst(i), &schedule, start))
    };
    let mut flood: Vec<_> = (0..3)
        .map(|i| {
            flood_sender(
                i,
                PHASES
                    .iter()
                    .zip(ends)
                    .map(|(p, &e)| (e, FLOOD_PPS * p.split[i] / 100))
                    .collect(),
            )
        })
        .collect();
    flood.push(flood_sender(3, vec![(ends[ends.len() - 1], INTRUDER_PPS)]));
    flood
}

/// The polite source's senders, `POLITE_PPS` to each of h0..h2 throughout. Each returns the
/// datagrams it sent.
fn spawn_polite<'scope>(
    s: &'scope Scope<'scope, '_>,
    tx: &Netns,
    ends: &[f64],
    start: Instant,
) -> Vec<ScopedJoinHandle<'scope, u64>> {
    (0..3)
        .map(|i| {
            let sock = bind_udp(tx, SocketAddr::new(IpAddr::V4(POLITE), 0)).unwrap();
            let schedule = vec![(ends[ends.len() - 1], POLITE_PPS)];
            s.spawn(move || paced(&sock, dst(i), &schedule, start))
        })
        .collect()
}

/// The sampler: the receivers' counts of the flood source every `SAMPLE` until `last_end`.
/// It has a thread of its own: the main thread's `status` calls at the phase boundaries took up
/// to 5 s on a loaded CI machine, and a sampler waiting for them left a gap that read as slow
/// convergence.
fn spawn_sampler<'scope, 'env>(
    s: &'scope Scope<'scope, 'env>,
    receivers: &'env [Receiver],
    last_end: f64,
    start: Instant,
) -> ScopedJoinHandle<'scope, Vec<Sample>> {
    let flood_ip = IpAddr::V4(FLOOD);
    s.spawn(move || {
        let mut samples = Vec::new();
        loop {
            let t = start.elapsed().as_secs_f64();
            if t >= last_end {
                break samples;
            }
            let mut counts = [0; 4];
            for (c, r) in counts.iter_mut().zip(receivers) {
                *c = r.counts().get(&flood_ip).copied().unwrap_or(0);
            }
            samples.push(Sample { t, flood: counts });
            thread::sleep(SAMPLE.min(Duration::from_secs_f64(last_end - t)));
        }
    })
}

/// One phase, until `end`: its action at the start (h0's gossip link down or up, h2's agent
/// killed), then the wait, reading the good agents' late rounds while they hear each other;
/// records every agent's status at its end and the gossip h0..h2 sent meanwhile.
fn play_phase(
    phase: &Phase,
    end: f64,
    agents: &mut [AgentProcess],
    hosts: &[ClusterHost],
    down: &mut [bool; 4],
    run: &mut Run,
) {
    let start = run.start;
    if let Some(up) = phase.h0_gossip {
        hosts[0]
            .ns
            .ip(&[
                "link",
                "set",
                &hosts[0].gossip_if,
                if up { "up" } else { "down" },
            ])
            .unwrap();
    }
    if phase.crash_h2 {
        agents[2].crash().unwrap();
        down[2] = true;
    }
    let before: Vec<(u64, u64)> = (0..3)
        .map(|i| {
            let sent = if down[i] {
                0
            } else {
                counter(&status(&agents[i]), "bytes_out")
            };
            (sent, tx_bytes(&hosts[i].ns, &hosts[i].gossip_if))
        })
        .collect();
    let t_before = start.elapsed().as_secs_f64();
    let connected = run.phase_bounds.len() < 2;
    loop {
        let left = end - start.elapsed().as_secs_f64();
        // While connected the late rounds are read every 2 s (a loaded machine may run
        // 32 late in a phase); not in the last 2.5 s, so that a slow read does not hold
        // up the next phase's action.
        if !connected || left < 2.5 {
            thread::sleep(Duration::from_secs_f64(left.max(0.0)));
            break;
        }
        thread::sleep(Duration::from_secs(2));
        run.readings
            .extend((0..3).map(|i| (i, unix_ms(), status(&agents[i]))));
    }
    let statuses: Vec<Value> = agents
        .iter()
        .zip(*down)
        .map(|(a, d)| if d { Value::Null } else { status(a) })
        .collect();
    if connected {
        let at = unix_ms();
        run.readings
            .extend((0..3).map(|i| (i, at, statuses[i].clone())));
    }
    let t_after = start.elapsed().as_secs_f64();
    run.gossip_bytes.push(
        (0..3)
            .map(|i| {
                #[expect(clippy::cast_precision_loss, reason = "small counts")]
                let per_sec = |n: u64| n as f64 / (t_after - t_before);
                let sent = if down[i] {
                    0
                } else {
                    counter(&statuses[i], "bytes_out") - before[i].0
                };
                (
                    per_sec(sent),
                    per_sec(tx_bytes(&hosts[i].ns, &hosts[i].gossip_if) - before[i].1),
                )
            })
            .collect::<Vec<_>>(),
    );
    run.statuses_after.push(statuses);
}

/// Sends `PAYLOAD`-byte datagrams from `sock` to `dst` following `schedule`, a list of (end in
/// seconds after `start`, packets per second), until its last end. Falls at most 16 packets
/// behind (after a preemption) rather than bursting to catch up. Returns the datagrams sent.
fn paced(
    sock: &std::net::UdpSocket,
    dst: SocketAddr,
    schedule: &[(f64, u64)],
    start: Instant,
) -> u64 {
    let payload = [0u8; PAYLOAD];
    let (mut sent, mut due, mut last) = (0u64, 0.0f64, start.elapsed().as_secs_f64());
    loop {
        let t = start.elapsed().as_secs_f64();
        let Some(&(_, pps)) = schedule.iter().find(|(end, _)| t < *end) else {
            return sent;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let (pps, sent_f) = (pps as f64, sent as f64);
        due = (due + (t - last) * pps).min(sent_f + 16.0);
        last = t;
        while (sent as f64) < due {
            match sock.send_to(&payload, dst) {
                Ok(_) => sent += 1,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {
                    due -= 1.0
                }
                Err(e) => panic!("sending to {dst}: {e}"),
            }
        }
        let wait = if pps > 0.0 {
            ((sent as f64 + 1.0 - due) / pps).clamp(0.0, 0.005)
        } else {
            0.005
        };
        thread::sleep(Duration::from_secs_f64(wait));
    }
}
