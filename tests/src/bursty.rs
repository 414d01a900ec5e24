//! Bursty traffic for the cluster tests, and what one bucket would make of it.
//!
//! Real senders are not paced: a client sends a batch back to back, then nothing until its next
//! batch. [`send_bursts`] sends such a [`Plan`] from one UDP socket (one source address) to
//! several hosts, each burst as fast as the socket takes it, and records the send time and host
//! of every datagram (each carries a [`Header`] whose sequence number is its index in the
//! [`BurstLog`], so [`BurstLog::admitted`] can tell exactly which got through from the
//! receivers). [`one_bucket`] runs the same datagrams, merged in send order, through one GCRA
//! bucket: what a single limiter in front of all the hosts would have admitted. A cluster
//! budget is compared with that, over the same datagrams, so a sender delayed by a busy machine
//! changes the reference as much as what it measures.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

use crate::netns::next_id;
use crate::receiver::{Receiver, STALL};
use crate::wire::{Header, HEADER_LEN};

/// One burst: `size` datagrams back to back to host `host`, due `at` seconds after the start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Burst {
    /// Seconds after the start.
    pub at: f64,
    /// The destination's index.
    pub host: usize,
    /// Datagrams.
    pub size: u32,
}

/// Bursts to send, in any order ([`send_bursts`] sends them by due time).
#[derive(Clone, Debug, Default)]
pub struct Plan(pub Vec<Burst>);

impl Plan {
    /// Adds bursts of `size` to `host` every `period` seconds from `offset` until `until`
    /// (exclusive), keeping only those due while `on(t)` holds (`|_| true` for all of them).
    #[must_use]
    pub fn periodic(
        mut self,
        host: usize,
        size: u32,
        period: f64,
        offset: f64,
        until: f64,
        on: impl Fn(f64) -> bool,
    ) -> Self {
        assert!(period > 0.0, "period {period}");
        let mut k = 0u32;
        loop {
            let at = offset + f64::from(k) * period;
            if at >= until {
                return self;
            }
            if on(at) && size > 0 {
                self.0.push(Burst { at, host, size });
            }
            k += 1;
        }
    }

    /// The last burst's due time (0 for none).
    #[must_use]
    pub fn end(&self) -> f64 {
        self.0.iter().map(|b| b.at).fold(0.0, f64::max)
    }

    /// Datagrams planned for each of `hosts` hosts.
    #[must_use]
    pub fn per_host(&self, hosts: usize) -> Vec<u64> {
        let mut n = vec![0; hosts];
        for b in &self.0 {
            n[b.host] += u64::from(b.size);
        }
        n
    }
}

/// One datagram [`send_bursts`] sent: when (seconds after the start, just after the send
/// returned) and to which host. Its sequence number is its index in [`BurstLog::sent`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SentDatagram {
    /// Seconds after the start.
    pub t: f64,
    /// The destination's index.
    pub host: usize,
}

/// What [`send_bursts`] sent.
#[derive(Clone, Debug, Default)]
pub struct BurstLog {
    /// The [`Header`] sender id of every datagram.
    pub sender: u64,
    /// The source address.
    pub source: Option<IpAddr>,
    /// Every datagram sent, in send order (= sequence number).
    pub sent: Vec<SentDatagram>,
    /// Sends refused for want of buffer space (`ENOBUFS`, `EAGAIN`): not sent, not in `sent`.
    pub errors: u64,
    /// Bursts started [`STALL`] or more after they were due (the sender did not run): `(due,
    /// late by)`, seconds. The datagrams' times are the real ones all the same.
    pub late: Vec<(f64, f64)>,
    /// The longest a burst took from its first datagram to its last, seconds.
    pub longest_burst: f64,
}

impl BurstLog {
    /// Datagrams sent to each of `hosts` hosts with send times in `[t1, t2)`.
    #[must_use]
    pub fn per_host(&self, hosts: usize, t1: f64, t2: f64) -> Vec<u64> {
        let mut n = vec![0; hosts];
        for d in self.sent.iter().filter(|d| d.t >= t1 && d.t < t2) {
            n[d.host] += 1;
        }
        n
    }

    /// Which datagrams arrived, by sequence number: read from each host's receiver (`receivers[i]`
    /// is host `i`'s). A datagram that arrived at another host than the one it was sent to
    /// counts as not arrived.
    #[must_use]
    pub fn admitted(&self, receivers: &[Receiver]) -> Vec<bool> {
        let mut got = vec![false; self.sent.len()];
        let Some(source) = self.source else {
            return got;
        };
        for (h, r) in receivers.iter().enumerate() {
            for seq in r.seqs(source, self.sender) {
                if let Some(d) = usize::try_from(seq).ok().and_then(|i| self.sent.get(i)) {
                    if d.host == h {
                        got[usize::try_from(seq).unwrap_or(usize::MAX)] = true;
                    }
                }
            }
        }
        got
    }

    /// Of the datagrams with send times in `[t1, t2)`, those `mask` marks, per host.
    #[must_use]
    pub fn count_per_host(&self, mask: &[bool], hosts: usize, t1: f64, t2: f64) -> Vec<u64> {
        let mut n = vec![0; hosts];
        for (d, &m) in self.sent.iter().zip(mask) {
            if m && d.t >= t1 && d.t < t2 {
                n[d.host] += 1;
            }
        }
        n
    }

    /// The send times of the datagrams `mask` marks, ascending.
    #[must_use]
    pub fn times(&self, mask: &[bool]) -> Vec<f64> {
        self.sent
            .iter()
            .zip(mask)
            .filter(|(_, &m)| m)
            .map(|(d, _)| d.t)
            .collect()
    }
}

/// Sends `plan` from `sock` (bound to the source address) to `dsts` (host `i` is `dsts[i]`),
/// each burst back to back, bursts by due time; a burst due while the sender was held up goes
/// out as soon as it runs (none is skipped). Datagrams carry 64 bytes of payload starting with a
/// [`Header`] whose sequence number is the datagram's index in the returned log. Panics on any
/// send error but a full buffer (counted).
///
/// # Panics
/// On a send error other than `ENOBUFS`/`EAGAIN`, or a burst to a host `dsts` does not have.
#[must_use]
pub fn send_bursts(sock: &UdpSocket, dsts: &[SocketAddr], plan: &Plan, start: Instant) -> BurstLog {
    let mut bursts = plan.0.clone();
    bursts.sort_by(|a, b| a.at.total_cmp(&b.at));
    let sender = u64::from(std::process::id()) << 32 | (next_id() & 0xffff_ffff);
    let mut log = BurstLog {
        sender,
        source: sock.local_addr().ok().map(|a| a.ip()),
        ..BurstLog::default()
    };
    let mut payload = [0u8; 64];
    debug_assert!(payload.len() >= HEADER_LEN);
    for b in &bursts {
        let due = start + Duration::from_secs_f64(b.at);
        let now = Instant::now();
        if now < due {
            thread::sleep(due - now);
        }
        let late = start.elapsed().as_secs_f64() - b.at;
        if late >= STALL.as_secs_f64() {
            log.late.push((b.at, late));
        }
        let dst = dsts[b.host];
        let mut first = None;
        for _ in 0..b.size {
            let seq = log.sent.len() as u64;
            Header { sender, seq }.write(&mut payload);
            match sock.send_to(&payload, dst) {
                Ok(_) => {
                    let t = start.elapsed().as_secs_f64();
                    first.get_or_insert(t);
                    log.sent.push(SentDatagram { t, host: b.host });
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {
                    log.errors += 1;
                }
                Err(e) => panic!("sending to {dst}: {e}"),
            }
        }
        if let (Some(f), Some(l)) = (first, log.sent.last()) {
            log.longest_burst = log.longest_burst.max(l.t - f);
        }
    }
    log
}

/// What one GCRA bucket of `rate` per second and `burst` would admit of datagrams arriving at
/// `times` (seconds, ascending), starting full: a datagram at `t` conforms when
/// `max(tat, t) + 1/rate - t <= burst/rate`, and then moves the theoretical arrival time `tat`
/// to `max(tat, t) + 1/rate`. One flag per datagram.
#[must_use]
pub fn one_bucket(times: &[f64], rate: f64, burst: f64) -> Vec<bool> {
    let interval = 1.0 / rate;
    let tolerance = burst / rate;
    let mut tat = f64::NEG_INFINITY;
    times
        .iter()
        .map(|&t| {
            let next = tat.max(t) + interval;
            // 1 ns of slack for the float sums (the program counts in integer nanoseconds).
            let ok = next - t <= tolerance + 1e-9;
            if ok {
                tat = next;
            }
            ok
        })
        .collect()
}

/// The largest `n - rate x (t_last - t_first)` over any run of `n` consecutive times of `times`
/// (ascending): how far the admissions at `times` went beyond `rate x T` over the worst window
/// `T`, and that window's first and last time. `(0, 0, 0)` for no times.
#[must_use]
pub fn worst_excess(times: &[f64], rate: f64) -> (f64, f64, f64) {
    // excess(i, j) = (j - i + 1) - rate (t_j - t_i) = (j - rate t_j) - (i - 1 - rate t_i):
    // keep the smallest right-hand term seen so far.
    let mut best = (0.0, 0.0, 0.0);
    let mut min: Option<(f64, f64)> = None;
    for (j, &t) in (0u32..).zip(times) {
        let j = f64::from(j);
        let here = j - 1.0 - rate * t;
        if min.is_none_or(|(m, _)| here < m) {
            min = Some((here, t));
        }
        let (m, t0) = min.expect("set above");
        let e = j - rate * t - m;
        if e > best.0 {
            best = (e, t0, t);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::{one_bucket, worst_excess, Plan};

    #[test]
    fn one_bucket_admits_its_burst_then_the_rate() {
        // 150 back to back, then 150 back to back 0.25 s later: burst 200, rate 1000 admits 200
        // of the first 150 + ... all 150, then 50 left + 250 refilled = 200 capped at burst.
        let mut times = vec![0.0; 150];
        times.extend(std::iter::repeat_n(0.25, 150));
        let ok = one_bucket(&times, 1000.0, 200.0);
        assert_eq!(ok[..150].iter().filter(|&&o| o).count(), 150);
        assert_eq!(ok[150..].iter().filter(|&&o| o).count(), 150);
        // Over budget: 1,000 at once, twice, 1 s apart: 100 + 100 (the refill capped at burst).
        let mut times = vec![0.0; 1000];
        times.extend(std::iter::repeat_n(1.0, 1000));
        let ok = one_bucket(&times, 1000.0, 100.0);
        assert_eq!(ok.iter().filter(|&&o| o).count(), 200);
        // Paced at the rate: everything.
        let times: Vec<f64> = (0..1000).map(|i| f64::from(i) / 1000.0).collect();
        assert!(one_bucket(&times, 1000.0, 1.0).iter().all(|&o| o));
    }

    #[test]
    fn worst_excess_finds_the_densest_window() {
        let mut times: Vec<f64> = (0..100).map(|i| f64::from(i) * 0.1).collect();
        // 50 extra at 5.0 s.
        times.extend(std::iter::repeat_n(5.0, 50));
        times.sort_by(f64::total_cmp);
        let (e, a, b) = worst_excess(&times, 10.0);
        // The 50 extra and the one paced at 5.0 itself over a window of 0: 51 (the windows
        // from earlier on, rate x T more of both, tie).
        assert!((e - 51.0).abs() < 1e-6, "{e} {a} {b}");
        assert!(a <= 5.0 + 1e-9 && b >= 5.0 - 1e-9, "{e} {a} {b}");
        assert_eq!(worst_excess(&[], 1.0), (0.0, 0.0, 0.0));
    }

    #[test]
    fn a_periodic_plan_keeps_only_its_on_times() {
        let p = Plan::default().periodic(1, 10, 0.25, 0.125, 1.0, |_| true);
        assert_eq!(p.0.len(), 4);
        assert_eq!(p.per_host(2), vec![0, 40]);
        let p = Plan::default().periodic(0, 5, 0.1, 0.0, 2.0, |t| t % 1.0 < 0.25);
        assert_eq!(p.0.len(), 6);
    }
}
