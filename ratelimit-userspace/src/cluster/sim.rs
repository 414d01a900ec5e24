//! A simulated cluster on a virtual clock, running the real share arithmetic: the agent's
//! [`share`], [`share_word`], [`keep_tokens`] and [`DemandWindow`], and the XDP program's charge
//! ([`share_cost`], [`share_tolerance`]; one GCRA step per batch of packets that arrive at one
//! instant, as the program charges them one by one). Each host publishes its demand every sync
//! interval, its rounds at its own point of the interval and now and then late ([`Jitter`]);
//! the others read it at their next round, or keep the older figure when the publication is
//! lost. As the agents do, a host reads a key new to it from its first round (its bucket's
//! counters start at its creation; read over the time since its round before, as its peers read
//! it), divides by its fresh figure until it has published one,
//! reads a bursty key over the agent's span of time, and through gossip reads a peer's new key
//! as demand since that peer's sync before. Arrivals are what real sources send: smooth,
//! periodic bursts (a TCP window, a batch), on/off, Poisson, heavy-tailed bursts, a ramp, a
//! split that moves, a source that appears at one host only, spoofed one-frame holders. A host
//! divides by its own figure as it published it last round, where the agents take theirs
//! nearest the oldest counted peer's sync (`OwnFigures`): about a round old either way at a few
//! hosts, up to two at many with gossip losses (docs/journal.md, "Bursty keys through lossy
//! gossip").
//!
//! The property test draws hosts 2-64, bursts 1-10,000, rates 1-10^6 packets/s and sync
//! intervals 10-1,000 ms, and checks over every window of the run: the cluster admits at most
//! docs/cluster.md's bound; over 7 s, at least 95% of what one bucket of the same rate and burst
//! admits of the same arrivals; and under the budget (the arrivals conform to half the rate and
//! burst), no host drops a packet.

use ratelimit_common::share;

use super::{
    remote::DemandWindow,
    shares::{share as share_of, share_word},
    timing::Timing,
};

const MS: u64 = 1_000_000;
/// The lag of docs/cluster.md's bound, in sync intervals: a key's demand is known at the first
/// round after its bucket's creation (its first reading counts from the creation), published,
/// read by the peers at their next round (through gossip, as demand since the host's sync
/// before), a round later when gossip lost it once, and a round to spare for the rounds'
/// lateness.
pub const LAG_INTERVALS: f64 = 4.0;
/// The simulation's step: arrivals within a step come at one instant.
const STEP: u64 = MS;
/// The virtual clock's start (ms): far from 0, as a host's monotonic clock is.
const START_MS: u64 = 1_000_000;

/// A small deterministic generator (xorshift64*), so a failing case can be run again by its seed.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    #[expect(clippy::cast_precision_loss, reason = "a fraction")]
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Log-uniform in [lo, hi].
    pub fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.unit() * (hi.ln() - lo.ln())).exp()
    }
}

/// One cluster-scoped bucket with share field `field` (word and holders,
/// `ratelimit_common::share::field`; shares in force), charged as the program charges it
/// (`ratelimit_common::share::admit`: the program's step, `k` times at once): `k` packets
/// arriving at `now`. Returns how many conform.
pub fn charge_batch(
    tat: &mut u64,
    now: u64,
    k: u64,
    limit: &ratelimit_common::Limit,
    field: u64,
) -> u64 {
    let dom = share::domain(true, field, true);
    share::admit(
        tat,
        now,
        k,
        limit.pkt_interval_ns,
        limit.pkt_tolerance_ns,
        dom,
    )
}

/// The bucket's TAT once the agent gives it share field `to` instead of `from`
/// (`MappedStore::set_share`: its tokens kept, at most what `to` holds).
#[must_use]
pub fn rewrite(tat: u64, now: u64, from: u64, to: u64, limit: &ratelimit_common::Limit) -> u64 {
    if from == to {
        return tat;
    }
    let (tol, cost) = (limit.pkt_tolerance_ns, limit.pkt_interval_ns);
    share::rewrite(
        tat,
        now,
        from,
        to,
        share::capacity(tol, cost, from),
        share::capacity(tol, cost, to),
    )
}

/// One bucket at the whole rate (the reference): `k` packets at `now`.
fn charge_one(tat: &mut u64, now: u64, k: u64, cost: u64, tolerance: u64) -> u64 {
    share::admit(tat, now, k, cost, tolerance, share::domain(false, 0, false))
}

/// A limit: rate (packets/s) and burst (packets), as the agent compiles them.
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    pub rate: f64,
    pub burst: u64,
}

impl Limit {
    fn record(self) -> ratelimit_common::Limit {
        ratelimit_common::Limit {
            flags: ratelimit_common::rule_flags::PKT_LIMIT | ratelimit_common::rule_flags::CLUSTER,
            pkt_interval_ns: self.interval(),
            pkt_tolerance_ns: self.tolerance(),
            ..ratelimit_common::Limit::default()
        }
    }

    fn interval(self) -> u64 {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "ns"
        )]
        let i = (1e9 / self.rate).ceil() as u64;
        i.max(1)
    }
    fn tolerance(self) -> u64 {
        self.burst * self.interval()
    }
}

#[derive(Clone, Default)]
struct Host {
    tat: u64,
    word: u16,
    /// The hosts holding the key as its share was computed (this one and the peers it heard).
    holders: u64,
    /// Whether this host has a bucket of the key (it saw a packet of it).
    holds: bool,
    /// When its bucket was created (its first packet).
    born: u64,
    /// When its last round ran.
    last_round: u64,
    demand: u64,
    admitted: u64,
    window: DemandWindow,
    /// What it published last (its own figure, as its peers read it once gossip brings it).
    published: Option<f64>,
    /// Its view of every host's figure: what gossip brought it (each pair on its own).
    views: Vec<Option<f64>>,
    /// Per host, its demand counter's readings as gossip brought them here (`Sim::counters`).
    peer_windows: Vec<DemandWindow>,
    /// Per host, whether its last publication was lost on the way here (gossip brings the next
    /// one: never two in a row).
    lost: Vec<bool>,
    /// Per host, when its last round whose publication reached here ran (its sync key's time).
    synced: Vec<Option<u64>>,
}

/// A simulated cluster for one key.
pub struct Sim {
    pub limit: Limit,
    pub sync: u64,
    /// Whether the hosts publish their demand counters and each peer reads the rate over the
    /// readings it got (gossip), rather than the rates they read (the store).
    pub counters: bool,
    /// Probability that a host's publication is lost (its peers keep the older figure).
    pub loss: f64,
    hosts: Vec<Host>,
    /// One bucket of the same limit, fed every arrival: the reference.
    one_tat: u64,
    pub now: u64,
    rng: Rng,
    /// Per step: (cluster admitted, one bucket admitted, arrivals).
    pub steps: Vec<(u64, u64, u64)>,
    /// Packets dropped by any host.
    pub dropped: u64,
    /// Per host, when its next round runs: each agent's rounds run on its own timer, at its own
    /// point of the interval ([`Sim::with_phases`]).
    next_round: Vec<u64>,
    /// How late the rounds run; None: every round a sync interval after the last.
    pub jitter: Option<Jitter>,
    jitter_rng: Rng,
}

/// How late an agent's rounds run, each timed from the last as the agent's timer is (a
/// round `late` late moves the later ones on too): an agent on a loaded machine.
#[derive(Clone, Copy, Debug)]
pub struct Jitter {
    /// Every round up to this late (ns).
    pub max_ns: u64,
    /// One round in this many (drawn) up to `late_max_ns` later still.
    pub late_one_in: u64,
    pub late_max_ns: u64,
}

impl Jitter {
    fn draw(self, rng: &mut Rng) -> u64 {
        let mut late = rng.next() % self.max_ns.max(1);
        if self.late_one_in > 0 && rng.next().is_multiple_of(self.late_one_in) {
            late += rng.next() % self.late_max_ns.max(1);
        }
        late
    }
}

impl Sim {
    pub fn new(hosts: usize, limit: Limit, sync_ms: u64, seed: u64) -> Self {
        Self {
            limit,
            sync: sync_ms * MS,
            loss: 0.05,
            counters: false,
            hosts: vec![
                Host {
                    views: vec![None; hosts],
                    lost: vec![false; hosts],
                    synced: vec![None; hosts],
                    peer_windows: vec![DemandWindow::default(); hosts],
                    ..Host::default()
                };
                hosts
            ],
            one_tat: 0,
            now: START_MS * MS,
            rng: Rng::new(seed),
            steps: Vec::new(),
            dropped: 0,
            next_round: vec![(START_MS / sync_ms + 1) * sync_ms * MS; hosts],
            jitter: None,
            jitter_rng: Rng::new(seed ^ 0x5eed),
        }
    }

    /// The same with host `h`'s rounds `phases_ms[h]` into the interval (all at its start
    /// without).
    pub fn with_phases(mut self, phases_ms: &[u64]) -> Self {
        // The agents' rounds were running before the key came: each host's next one within an
        // interval.
        let start = self.now - self.now % self.sync;
        for (p, &ms) in self.next_round.iter_mut().zip(phases_ms) {
            *p = start + (ms * MS) % self.sync;
            if *p <= self.now {
                *p += self.sync;
            }
        }
        self
    }

    /// One step: `arrivals[h]` packets reach host `h` at this instant.
    pub fn step(&mut self, arrivals: &[u64]) {
        self.now += STEP;
        let interval = self.limit.interval();
        let tolerance = self.limit.tolerance();
        let record = self.limit.record();
        let mut admitted = 0;
        let mut all = 0;
        for (h, &k) in self.hosts.iter_mut().zip(arrivals) {
            if k == 0 {
                continue;
            }
            if !h.holds {
                h.born = self.now;
            }
            h.holds = true;
            h.demand += k;
            all += k;
            let field = share::field(u64::from(h.word), h.holders);
            let n = charge_batch(&mut h.tat, self.now, k, &record, field);
            h.admitted += n;
            admitted += n;
            self.dropped += k - n;
        }
        let one = charge_one(&mut self.one_tat, self.now, all, interval, tolerance);
        self.steps.push((admitted, one, all));
        let now = self.now;
        if self.next_round.iter().any(|&t| t <= now) {
            let due: Vec<bool> = self.next_round.iter().map(|&t| t <= now).collect();
            self.round(&due);
            for (t, _) in self.next_round.iter_mut().zip(&due).filter(|(_, d)| **d) {
                let late = self.jitter.map_or(0, |j| j.draw(&mut self.jitter_rng));
                *t = now + self.sync + late;
            }
        }
    }

    /// A sync round at every host `due`: read the others' published demand (a round old), set
    /// the share word (keeping the bucket's tokens), then publish this round's figure.
    fn round(&mut self, due: &[bool]) {
        let now = self.now;
        let record = self.limit.record();
        let span = Timing::new(self.sync / MS).demand_span_ns();
        let fresh: Vec<Option<f64>> = self
            .hosts
            .iter_mut()
            .zip(due)
            .map(|(h, &due)| {
                if !due {
                    return None;
                }
                let last = std::mem::replace(&mut h.last_round, now);
                if !h.holds {
                    return None;
                }
                // A bucket born since the last round: all it counted is demand since then,
                // known at this first reading (the agent's `local_demand`).
                if h.window.is_empty() && h.born > last {
                    h.window.push(last, 0);
                }
                h.window.push(now, h.demand);
                (h.window.len() >= 2).then(|| h.window.rate(1e9, span))
            })
            .collect();
        let n = self.hosts.len();
        for i in (0..n).filter(|&i| due[i]) {
            let h = &self.hosts[i];
            // Its own figure as its peers read it (published last round; a key new here, its
            // fresh one: the agent's `own_demand`), theirs as gossip brought them here: each
            // host's view is its own, as the agents' are.
            let Some(own) = h.published.or(fresh[i]) else {
                continue;
            };
            let peers: Vec<f64> = (0..n)
                .filter(|&o| o != i)
                .filter_map(|o| h.views[o])
                .collect();
            let holders = 1 + peers.len() as u64;
            #[expect(clippy::cast_precision_loss, reason = "64 hosts at most")]
            let s = share_of(
                own,
                peers.iter().sum(),
                1.0,
                Some(self.limit.rate),
                holders as f64,
            );
            let word = share_word(s);
            let h = &mut self.hosts[i];
            let (from, to) = (
                share::field(u64::from(h.word), h.holders),
                share::field(u64::from(word), holders),
            );
            h.tat = rewrite(h.tat, now, from, to, &record);
            h.word = word;
            h.holders = holders;
        }
        for (h, f) in self.hosts.iter_mut().zip(fresh) {
            if f.is_some() {
                h.published = f;
            }
        }
        // Gossip: each host's new figure reaches each peer within the interval, or (lost) the
        // round after.
        // Through gossip a host's sync travels every round, and its counter of the key from the
        // round it first holds it; a peer reads a key new since it counted the host as demand
        // since the host's sync before (the agent's `fold_keys`): known at its first reading.
        let published: Vec<(Option<f64>, u64, bool)> = self
            .hosts
            .iter()
            .map(|h| (h.published, h.demand, h.holds))
            .collect();
        for (r, h) in self.hosts.iter_mut().enumerate() {
            for (o, &(p, count, holds)) in published.iter().enumerate() {
                if o == r || !due[o] || (!self.counters && p.is_none()) {
                    continue;
                }
                if !h.lost[o] && self.rng.unit() < self.loss {
                    h.lost[o] = true;
                    continue;
                }
                h.lost[o] = false;
                // Before the key, the host's rounds ran an interval apart.
                let before = h.synced[o].replace(now).unwrap_or(now - self.sync);
                if !self.counters {
                    h.views[o] = p;
                } else if holds {
                    let w = &mut h.peer_windows[o];
                    if w.is_empty() {
                        w.push(before, 0);
                    }
                    w.push(now, count);
                    h.views[o] = (w.len() >= 2).then(|| w.rate(1e9, span));
                }
            }
        }
    }

    /// Cluster admitted, one bucket admitted and arrivals over steps `a..b`.
    pub fn totals(&self, a: usize, b: usize) -> (u64, u64, u64) {
        self.steps[a..b]
            .iter()
            .fold((0, 0, 0), |(x, y, z), &(p, q, r)| (x + p, y + q, z + r))
    }

    /// The most the cluster admitted over any window of `len` steps, over `rate x len`.
    pub fn worst_excess(&self, len: usize) -> f64 {
        let mut sum: u64 = self.steps[..len.min(self.steps.len())]
            .iter()
            .map(|s| s.0)
            .sum();
        #[expect(clippy::cast_precision_loss, reason = "packets")]
        let budget = self.limit.rate * (len as f64) * STEP as f64 / 1e9;
        #[expect(clippy::cast_precision_loss, reason = "packets")]
        let mut worst = sum as f64 - budget;
        for i in len..self.steps.len() {
            sum = sum + self.steps[i].0 - self.steps[i - len].0;
            #[expect(clippy::cast_precision_loss, reason = "packets")]
            let e = sum as f64 - budget;
            worst = worst.max(e);
        }
        worst
    }

    /// docs/cluster.md's bound on the excess over `rate x T` in any window: `(2 x hosts - 1) x
    /// burst` (each host's bucket holds the whole burst, or `holders x share` bursts if that is 1.5 or more:
    /// with shares adding up to 1, at most `2 x hosts - 1` bursts together) plus `(hosts - 1) x
    /// rate x lag` (a new key refills at the whole rate at every host until its first shares, and
    /// shares follow figures a lag old), the lag [`LAG_INTERVALS`] sync intervals.
    pub fn bound(&self) -> f64 {
        #[expect(clippy::cast_precision_loss, reason = "small")]
        let n = self.hosts.len() as f64;
        #[expect(clippy::cast_precision_loss, reason = "small")]
        let (burst, lag) = (
            self.limit.burst as f64,
            LAG_INTERVALS * self.sync as f64 / 1e9,
        );
        (2.0 * n - 1.0) * burst + (n - 1.0) * self.limit.rate * lag
    }
}

/// Arrival processes real sources produce, per host and step.
#[derive(Clone, Copy, Debug)]
pub enum Arrivals {
    /// `pps` spread as evenly as steps allow.
    Smooth,
    /// A burst back to back every `period_ms` at each host (its share of the rate), phases
    /// spread over the hosts.
    Periodic { period_ms: u64 },
    /// On for `on_ms` (at `pps`), off for `off_ms`.
    OnOff { on_ms: u64, off_ms: u64 },
    /// Packets as a Poisson process.
    Poisson,
    /// Bursts at Poisson times, Pareto-sized (shape 1.5), with the same mean rate.
    HeavyTailed { mean_burst: f64 },
    /// From 0 to `2 x pps` over the run.
    Ramp,
}

/// A source: `pps` in all, `weights` its split over the hosts, `arrivals` its shape.
#[derive(Clone, Debug)]
pub struct Source {
    pub pps: f64,
    pub weights: Vec<f64>,
    pub arrivals: Arrivals,
}

/// Per-host state of a source's arrival process.
pub struct Driver {
    source: Source,
    carry: Vec<f64>,
    rng: Rng,
    step_i: u64,
    steps: u64,
}

impl Driver {
    pub fn new(source: Source, steps: u64, seed: u64) -> Self {
        let n = source.weights.len();
        Self {
            source,
            carry: vec![0.0; n],
            rng: Rng::new(seed),
            step_i: 0,
            steps,
        }
    }

    /// The packets arriving at each host in the next step.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "packet counts"
    )]
    pub fn next(&mut self) -> Vec<u64> {
        let i = self.step_i;
        self.step_i += 1;
        let total: f64 = self
            .source
            .weights
            .iter()
            .sum::<f64>()
            .max(f64::MIN_POSITIVE);
        let n = self.source.weights.len();
        let mut out = vec![0u64; n];
        #[expect(clippy::needless_range_loop, reason = "three arrays by host")]
        for h in 0..n {
            let pps = self.source.pps * self.source.weights[h] / total;
            if pps <= 0.0 {
                continue;
            }
            let per_step = pps * STEP as f64 / 1e9;
            let k = match self.source.arrivals {
                Arrivals::Smooth => {
                    self.carry[h] += per_step;
                    let k = self.carry[h].floor();
                    self.carry[h] -= k;
                    k as u64
                }
                Arrivals::Ramp => {
                    self.carry[h] += per_step * 2.0 * i as f64 / self.steps.max(1) as f64;
                    let k = self.carry[h].floor();
                    self.carry[h] -= k;
                    k as u64
                }
                Arrivals::Periodic { period_ms } => {
                    let phase = h as u64 * period_ms / n as u64;
                    if (i + phase).is_multiple_of(period_ms.max(1)) {
                        self.carry[h] += pps * period_ms as f64 / 1e3;
                        let k = self.carry[h].floor();
                        self.carry[h] -= k;
                        k as u64
                    } else {
                        0
                    }
                }
                Arrivals::OnOff { on_ms, off_ms } => {
                    if i % (on_ms + off_ms) < on_ms {
                        self.carry[h] += per_step;
                        let k = self.carry[h].floor();
                        self.carry[h] -= k;
                        k as u64
                    } else {
                        0
                    }
                }
                Arrivals::Poisson => poisson(&mut self.rng, per_step),
                Arrivals::HeavyTailed { mean_burst } => {
                    let bursts = poisson(&mut self.rng, per_step / mean_burst);
                    (0..bursts)
                        .map(|_| {
                            // Pareto with shape 1.5 and mean `mean_burst`: scale mean / 3.
                            let u = self.rng.unit().max(1e-12);
                            (mean_burst / 3.0 * u.powf(-1.0 / 1.5)).round() as u64
                        })
                        .sum()
                }
            };
            out[h] = k;
        }
        out
    }
}

#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a count"
)]
fn poisson(rng: &mut Rng, mean: f64) -> u64 {
    if mean > 30.0 {
        // Normal approximation.
        let u1 = rng.unit().max(1e-12);
        let u2 = rng.unit();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        return (mean + z * mean.sqrt()).round().max(0.0) as u64;
    }
    let l = (-mean).exp();
    let (mut k, mut p) = (0u64, 1.0);
    loop {
        p *= rng.unit();
        if p <= l {
            return k;
        }
        k += 1;
    }
}

#[cfg(test)]
mod tests;
