//! A demand counter's window of readings, and the rate read over it.

/// Demand is a rate over at least this many sync intervals (a peer's last syncs, and this
/// host's own readings likewise), and further back while that holds fewer than
/// [`DEMAND_PACKETS`]: a source that sends in bursts (a TCP window, a batch) reads 0 between
/// them over one interval, and its host's share collapsed to nothing, then came back to an
/// empty bucket at the next burst (issue #34: two hosts sending 150 back to back every 250 ms
/// admitted 0.67 of one bucket). Over four, the simulator's property test (`cluster::sim`)
/// failed 1 case of 300 where over one it failed 5, over two 1.
pub const DEMAND_ROUNDS: usize = 2;

/// A window reaches back past [`DEMAND_ROUNDS`] until it holds this many packets (or its
/// oldest reading, [`DEMAND_HISTORY`] back): a key sending a few packets a second at a host is
/// read over seconds, not as 0 most rounds and a spike at the rest; a key that stopped reads
/// about this many over the time since it stopped, which falls off at once.
pub const DEMAND_PACKETS: u64 = 4;

/// Readings a window keeps: how far back it reaches for [`DEMAND_PACKETS`], so a key that
/// stopped reads 0 this many syncs later (and nothing is withheld for it any more).
pub const DEMAND_HISTORY: usize = 6;

/// A cumulative demand counter's readings, `(time, count)`, the last [`DEMAND_HISTORY`] + 1.
#[derive(Clone, Debug, Default)]
pub struct DemandWindow(std::collections::VecDeque<(u64, u64)>);

impl DemandWindow {
    /// Adds a reading. One at the time of the last is ignored (the same reading again); one
    /// before it, or with a count below the last one's, starts the window again from it: the
    /// readings before were wrong (a clock stepped back, or a forged reading ahead of the
    /// real ones), and a window that ignored every later reading would keep their rate for ever.
    pub fn push(&mut self, at: u64, count: u64) {
        if let Some(&(t, c)) = self.0.back() {
            if at == t {
                return;
            }
            if at < t || count < c {
                self.0.clear();
            }
        }
        self.0.push_back((at, count));
        while self.0.len() > DEMAND_HISTORY + 1 {
            self.0.pop_front();
        }
    }

    fn between((t0, c0): (u64, u64), (t1, c1): (u64, u64), per: f64) -> f64 {
        if t1 <= t0 {
            return 0.0;
        }
        #[expect(clippy::cast_precision_loss, reason = "a rate")]
        let r = c1.saturating_sub(c0) as f64 * per / (t1 - t0) as f64;
        r
    }

    /// The time of the newest reading.
    #[must_use]
    pub fn last_at(&self) -> Option<u64> {
        self.0.back().map(|&(t, _)| t)
    }

    /// How many readings it holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The counter's gain per unit of time (per `per` units) over its last [`DEMAND_ROUNDS`]
    /// readings; 0 with fewer than two. Where they gained fewer than [`DEMAND_PACKETS`], the
    /// window reaches back over older readings until it holds that many, counting the packets of
    /// the interval that completes them as spread evenly over it: the rate is then
    /// `DEMAND_PACKETS` over the time they took. A key that stopped reads that many over the
    /// time since it stopped (falling off at once, not a whole interval's packets over it); a
    /// key sending a packet now and then reads its rate, not 0 most rounds.
    #[must_use]
    pub fn rate(&self, per: f64) -> f64 {
        let Some(&newest) = self.0.back() else {
            return 0.0;
        };
        let n = self.0.len();
        let from = n.saturating_sub(DEMAND_ROUNDS + 1);
        let gain = newest.1.saturating_sub(self.0[from].1);
        if gain >= DEMAND_PACKETS || from == 0 {
            return Self::between(self.0[from], newest, per);
        }
        let mut j = from;
        while j > 0 {
            let (t0, c0) = self.0[j - 1];
            let (t1, c1) = self.0[j];
            let more = c1.saturating_sub(c0);
            let have = newest.1.saturating_sub(c1);
            if have + more >= DEMAND_PACKETS && more > 0 && t1 > t0 {
                // The last `DEMAND_PACKETS - have` of the `more` in [t0, t1], spread evenly.
                #[expect(clippy::cast_precision_loss, reason = "a rate")]
                let part = (DEMAND_PACKETS - have) as f64 / more as f64 * (t1 - t0) as f64;
                #[expect(clippy::cast_precision_loss, reason = "a rate")]
                let span = newest.0.saturating_sub(t1) as f64 + part;
                #[expect(clippy::cast_precision_loss, reason = "a rate")]
                return if span > 0.0 {
                    DEMAND_PACKETS as f64 * per / span
                } else {
                    0.0
                };
            }
            j -= 1;
        }
        Self::between(self.0[0], newest, per)
    }
}
