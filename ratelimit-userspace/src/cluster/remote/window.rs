//! A demand counter's window of readings, and the rate read over it.

/// Demand is a rate over at least this many sync intervals (a peer's last syncs, and this
/// host's own readings likewise), over all the readings kept for a bursty key (see
/// [`DemandWindow::rate`]): over one interval a source that sends in bursts (a TCP window, a
/// batch) reads 0 between them, and its host's share collapsed to nothing, then came back to
/// an empty bucket at the next burst (issue #34: two hosts sending 150 back to back every
/// 250 ms admitted 0.67 of one bucket).
pub const DEMAND_ROUNDS: usize = 2;

/// Below this many packets over [`DEMAND_ROUNDS`], a window reaches back until it holds this
/// many: a key sending a few packets a second at a host is read at its rate, not as 0 most
/// rounds and a spike at the rest; one that stopped reads this many over the time since.
pub const DEMAND_PACKETS: u64 = 4;

/// Intervals a window keeps (readings: one more): how far back it reads a bursty or sparse key
/// (a bursty one over this many sync intervals of time, [`DemandWindow::rate`]'s `span`), and
/// half the readings a key stays bursty for after its last gap; a key that stopped reads 0 this
/// many syncs later.
pub const DEMAND_HISTORY: usize = 6;

/// A cumulative demand counter's readings and whether the key is bursty.
#[derive(Clone, Debug, Default)]
pub struct DemandWindow {
    /// `(time, count)`, the last [`DEMAND_HISTORY`] + 1.
    readings: std::collections::VecDeque<(u64, u64)>,
    /// For how many more readings the key counts as bursty (see [`DemandWindow::rate`]).
    bursty_for: usize,
}

impl DemandWindow {
    /// Adds a reading. One at the time of the last is ignored (the same reading again); one
    /// before it, or with a count below the last one's, starts the window again from it: the
    /// readings before were wrong (a clock stepped back, or a forged reading ahead of the
    /// real ones), and a window that ignored every later reading would keep their rate for ever.
    pub fn push(&mut self, at: u64, count: u64) {
        if let Some(&(t, c)) = self.readings.back() {
            if at == t {
                return;
            }
            if at < t || count < c {
                self.readings.clear();
                self.bursty_for = 0;
            }
        }
        self.readings.push_back((at, count));
        while self.readings.len() > DEMAND_HISTORY + 1 {
            self.readings.pop_front();
        }
        self.bursty_for = if self.gap_within() {
            2 * DEMAND_HISTORY
        } else {
            self.bursty_for.saturating_sub(1)
        };
    }

    fn between((t0, c0): (u64, u64), (t1, c1): (u64, u64), per: f64) -> f64 {
        if t1 <= t0 {
            return 0.0;
        }
        #[expect(clippy::cast_precision_loss, reason = "a rate")]
        let r = c1.saturating_sub(c0) as f64 * per / (t1 - t0) as f64;
        r
    }

    /// Whether an interval between two readings that gained nothing lies between two that
    /// gained: the key sends in bursts (or a few packets) with gaps, rather than having
    /// started or stopped within the readings kept.
    fn gap_within(&self) -> bool {
        let mut sent = false;
        let mut gap = false;
        for (a, b) in self.readings.iter().zip(self.readings.iter().skip(1)) {
            if b.1 > a.1 {
                if gap {
                    return true;
                }
                sent = true;
            } else if sent {
                gap = true;
            }
        }
        false
    }

    /// The gain over the last `span` before `newest`, per `per` units of time: the count at
    /// `newest - span` read between the two readings around it, as if the packets between them
    /// had come evenly; over all the readings when they cover less (a key new to the window).
    fn over_span(&self, newest: (u64, u64), per: f64, span: u64) -> f64 {
        let from = newest.0.saturating_sub(span);
        let first = self.readings[0];
        if first.0 >= from || span == 0 {
            return Self::between(first, newest, per);
        }
        for (a, b) in self.readings.iter().zip(self.readings.iter().skip(1)) {
            if a.0 <= from && from < b.0 {
                #[expect(clippy::cast_precision_loss, reason = "a count")]
                let at = a.1 as f64
                    + b.1.saturating_sub(a.1) as f64 * (from - a.0) as f64 / (b.0 - a.0) as f64;
                #[expect(clippy::cast_precision_loss, reason = "a rate")]
                let r = (newest.1 as f64 - at).max(0.0) * per / span as f64;
                return r;
            }
        }
        Self::between(first, newest, per)
    }

    /// The time of the newest reading.
    #[must_use]
    pub fn last_at(&self) -> Option<u64> {
        self.readings.back().map(|&(t, _)| t)
    }

    /// How many readings it holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.readings.len()
    }

    /// Whether it holds none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.readings.is_empty()
    }

    /// The counter's gain per unit of time (per `per` units): over the last `span` (in the
    /// readings' unit of time; [`DEMAND_HISTORY`] sync intervals, all the readings kept where
    /// they cover less) while the key is bursty; else over its last
    /// [`DEMAND_ROUNDS`] readings, and where they gained fewer than [`DEMAND_PACKETS`], the
    /// last that many packets over the time they took (the packets of the interval that
    /// completes them spread evenly over it); 0 with fewer than two readings.
    ///
    /// A key is bursty once an interval that gained nothing lay between two that gained, and for
    /// 2 x [`DEMAND_HISTORY`] readings after the last time one did: a source that sends in bursts
    /// (a TCP window, a batch) leaves intervals empty, and over two intervals it read a burst
    /// or about 0 by turns (two hosts sent 150 every 250 ms, 125 ms apart: their shares swung
    /// between 0.03 and 0.97 with their rounds' timing, 0.86-1.05 of one bucket over 8 s in
    /// the simulator). Over the span it reads 2 or 3 bursts over 600 ms: a span that does not
    /// depend on where the bursts fall, so every reader reads the rate on average (reading a
    /// burst over the time since its interval began read it 1.17x at the host, at its rate
    /// where syncs were skipped: eight hosts' shares added up to 1.05). The span is time, not
    /// readings, so a peer whose gossip skipped some of the host's syncs reads the same span as
    /// the host (the count at its start read between the readings around it): over its 7
    /// readings, 8.5 intervals with 30% skipped, a peer read an on/off source (on 3 intervals,
    /// off 5) well above what the host read of itself early in each burst, and 16 hosts' shares
    /// added up to 0.43-0.89 while it sent (0.73 of one bucket). A gap shows within the
    /// readings kept only at the readings that hold both ends of it, one or two a cycle of such
    /// a source; bursty for 6 readings after, the key fell back to its two-interval reading
    /// for the rest of a cycle of 8, at some readers and not others. For 12, it stays bursty
    /// through any cycle whose gap the readings can show. A key that
    /// sends every interval keeps the two-interval window, so a change of split reaches the
    /// shares in two rounds, and one of them that stops falls off at once (4 packets over the
    /// time since), where a bursty key that stops falls off over the readings kept. Bursts
    /// more than [`DEMAND_HISTORY`] intervals apart never share the readings kept: such a key
    /// reads about 0 between them.
    #[must_use]
    pub fn rate(&self, per: f64, span: u64) -> f64 {
        let Some(&newest) = self.readings.back() else {
            return 0.0;
        };
        let n = self.readings.len();
        let from = n.saturating_sub(DEMAND_ROUNDS + 1);
        let gain = newest.1.saturating_sub(self.readings[from].1);
        if self.bursty_for > 0 {
            return self.over_span(newest, per, span);
        }
        if gain >= DEMAND_PACKETS || from == 0 {
            return Self::between(self.readings[from], newest, per);
        }
        for j in (1..=from).rev() {
            let (t0, c0) = self.readings[j - 1];
            let (t1, c1) = self.readings[j];
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
        }
        Self::between(self.readings[0], newest, per)
    }
}
