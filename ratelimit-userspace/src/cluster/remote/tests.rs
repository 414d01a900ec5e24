use std::net::IpAddr;

use super::*;

const S: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
/// Three 100 ms sync intervals.
const LAG: u64 = 300 * MS;
/// The span a bursty key is read over, as at a 100 ms sync interval.
const SPAN: u64 = DEMAND_HISTORY as u64 * 100 * MS;

fn name() -> KeyName {
    KeyName {
        rule: "flood".into(),
        limit: 0,
        addr: IpAddr::from([198, 18, 0, 100]),
    }
}

/// 1000 pps, burst 500.
const FLOOD: Limits = Limits {
    pkt_interval_ns: MS,
    pkt_tolerance_ns: 500 * MS,
    byte_interval_fp: 0,
    byte_tolerance_ns: 0,
};

fn limits() -> ClusterLimits {
    ClusterLimits::default().with("flood", 0, FLOOD)
}

/// A peer's view at heartbeat and sync sequence `hb`, published at `hb x 100 ms` by its
/// clock, with demand `counts` (`(epoch, packets)`) for [`name`].
fn view(id: &str, hb: u64, epoch_next: u64, counts: &[(u64, u64)]) -> PeerView<String> {
    PeerView {
        id: id.to_string(),
        live: true,
        verified: true,
        heartbeat: hb,
        heard_at: None,
        sync: Some((hb, hb * 100, epoch_next)),
        keys_digest: Some(keys_digest(counts.iter().map(|_| name().to_key()))),
        keys: counts
            .iter()
            .map(|&(epoch, demand)| {
                (
                    name(),
                    Count {
                        epoch,
                        pkts: demand / 2,
                        bytes: demand * 50,
                        demand,
                    },
                )
            })
            .collect(),
    }
}

/// The counted peers' demand for [`name`], in packets per 100 ms (one sync of the views).
fn per_sync(r: &Round<String>) -> u64 {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "test"
    )]
    let d = (r.peer_demand(&name()) / 10.0).round() as u64;
    d
}

/// `heard` (what the partition share and `peers` count as heard): a peer not tracked yet is;
/// a tracked one while its heartbeat moves, or within the timeout of its last move; not after
/// (found missed by cargo-mutants: `heard` answering false).
#[test]
fn a_peer_is_heard_while_its_heartbeat_moves_or_within_the_timeout() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let id = "a".to_string();
    assert!(t.heard(&id, 1, 0), "not tracked yet");
    t.round(S, &[view("a", 5, 2, &[(1, 100)])], &limits());
    assert!(t.heard(&id, 6, 10 * S), "its heartbeat moved");
    assert!(
        t.heard(&id, 5, S + 3 * S),
        "the same heartbeat, within the timeout"
    );
    assert!(
        !t.heard(&id, 5, S + 3 * S + 1),
        "the same heartbeat, past the timeout"
    );
}

/// Demand is what the cumulative counter gained over the peer's last syncs, by its clock: a
/// repeated sync changes nothing, a count that went back (chitchat never brings an older
/// value: the one before was not the peer's) adds nothing and starts the window again from
/// it, lost updates are caught up over the longer span, a new epoch counts from zero, an
/// older epoch adds nothing (and is a new baseline).
#[test]
fn demand_is_the_counters_gain_over_the_peers_own_time() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let rate = |r: &Round<String>| r.peer_demand(&name());
    // First sight: baseline, no demand known yet.
    assert_eq!(rate(&t.round(0, &[view("a", 1, 2, &[(1, 100)])], &l)), 0.0);
    // 50 packets over its 100 ms.
    let r = t.round(100 * MS, &[view("a", 2, 2, &[(1, 150)])], &l);
    assert!((rate(&r) - 500.0).abs() < 1e-9, "{r:?}");
    // The same sync read again (gossip brought nothing newer): the demand stands.
    let r = t.round(200 * MS, &[view("a", 2, 2, &[(1, 150)])], &l);
    assert!((rate(&r) - 500.0).abs() < 1e-9, "{r:?}");
    // Over its last `DEMAND_ROUNDS` = 2 syncs: 150 packets over 200 ms
    // of its clock.
    const _: () = assert!(
        DEMAND_ROUNDS == 2,
        "the figures below are for two intervals"
    );
    let r = t.round(300 * MS, &[view("a", 3, 2, &[(1, 250)])], &l);
    assert!((rate(&r) - 750.0).abs() < 1e-9, "{r:?}");
    // A count that went back: refused, nothing over 100 ms; the window starts from it.
    let r = t.round(400 * MS, &[view("a", 4, 2, &[(1, 120)])], &l);
    assert!(rate(&r).abs() < 1e-9, "{r:?}");
    assert_eq!(r.refused, 1);
    // Two syncs lost: the window spans its last two readings, 400..700 ms: 300 over 300 ms.
    let r = t.round(500 * MS, &[view("a", 7, 2, &[(1, 420)])], &l);
    assert!((rate(&r) - 1000.0).abs() < 1e-9, "{r:?}");
    // A new epoch of the key (it left and came back): counted from zero since its last sync.
    let r = t.round(600 * MS, &[view("a", 8, 3, &[(2, 30)])], &l);
    assert!((rate(&r) - 300.0).abs() < 1e-9, "{r:?}");
    // A stale report of the old epoch adds nothing: no gain over 100 ms.
    let r = t.round(700 * MS, &[view("a", 9, 3, &[(1, 500)])], &l);
    assert!(rate(&r).abs() < 1e-9, "{r:?}");
}

/// A source sending 150 back to back every 250 ms (600 pps), read every 100 ms, at every phase
/// of its bursts: read over all the readings kept (2 or 3 bursts over 600 ms), 500-750 pps, and
/// 600 on average over the phases, so a peer reading fewer of its syncs reads the same on
/// average. Over its last two readings it read 750 or, as the burst's last 4 packets over the
/// time since, about 20; a burst over the time since its interval began, 750 or 500 (700 on
/// average: 1.17x). A bursty key that stops falls to 0 once its packets are out of the readings
/// kept; one that sent every interval, at once.
#[test]
fn a_bursty_key_is_read_at_its_rate_whatever_the_phase_of_its_bursts() {
    let mut rates = Vec::new();
    for phase in (0..250u64).step_by(5) {
        let mut w = DemandWindow::default();
        for j in 0..=12u64 {
            let t = j * 100;
            let bursts = (0..10u64).filter(|k| phase + k * 250 < t).count() as u64;
            w.push(t * MS, 150 * bursts);
        }
        rates.push(w.rate(1e9, SPAN));
    }
    let (lo, hi) = rates
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
    #[expect(clippy::cast_precision_loss, reason = "50 phases")]
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    assert!(
        lo >= 500.0 - 1e-9 && hi <= 750.0 + 1e-9 && (mean - 600.0).abs() <= 12.0,
        "read {lo:.0}-{hi:.0} pps, {mean:.0} on average, where it sends 600"
    );
    // A bursty key that stops: read over the readings kept until its last burst is out of them.
    let mut w = DemandWindow::default();
    for (t, c) in [(0, 0), (100, 150), (200, 150), (300, 300), (400, 300)] {
        w.push(t * MS, c);
    }
    assert!(
        (w.rate(1e9, SPAN) - 750.0).abs() < 1e-9,
        "{}",
        w.rate(1e9, SPAN)
    );
    w.push(500 * MS, 300);
    assert!(
        (w.rate(1e9, SPAN) - 600.0).abs() < 1e-9,
        "{}",
        w.rate(1e9, SPAN)
    );
    for t in 6..=9 {
        w.push(t * 100 * MS, 300);
    }
    assert_eq!(w.len(), DEMAND_HISTORY + 1);
    assert_eq!(
        w.rate(1e9, SPAN),
        0.0,
        "its packets are out of the readings kept"
    );
    // A key that sent every interval and stops falls off at once: its last 4 packets over the
    // time since they came (100 a reading: 4 over 200 ms and the last 4 ms of the interval).
    let mut w = DemandWindow::default();
    for (t, c) in [
        (0, 0),
        (100, 100),
        (200, 200),
        (300, 300),
        (400, 300),
        (500, 300),
    ] {
        w.push(t * MS, c);
    }
    assert!(
        (w.rate(1e9, SPAN) - 4.0 / 0.204).abs() < 1e-6,
        "{}",
        w.rate(1e9, SPAN)
    );
}

/// A window reads over its last `DEMAND_ROUNDS` readings, over all it keeps where they hold
/// fewer than `DEMAND_PACKETS`; readings out of order are ignored.
#[test]
fn a_demand_window_spans_its_last_readings() {
    let mut w = DemandWindow::default();
    assert_eq!(w.rate(1.0, 6), 0.0);
    w.push(10, 5);
    assert_eq!(w.rate(1.0, 6), 0.0, "one reading");
    for i in 1..=10u64 {
        w.push(10 + i, 5 + i * i);
    }
    assert_eq!(w.len(), DEMAND_HISTORY + 1);
    let first = 10 - DEMAND_ROUNDS as u64;
    #[expect(clippy::cast_precision_loss, reason = "small numbers")]
    let want = (100 - first * first) as f64 / DEMAND_ROUNDS as f64;
    assert!((w.rate(1.0, 6) - want).abs() < 1e-9);
    // A sparse key (3 packets, none over its last 2 readings): read over all it keeps, not
    // as 0.
    let mut sparse = DemandWindow::default();
    for (t, c) in [(0, 0), (1, 1), (2, 2), (3, 3), (4, 3), (5, 3)] {
        sparse.push(t, c);
    }
    assert!(
        (sparse.rate(1.0, 6) - 0.6).abs() < 1e-9,
        "{}",
        sparse.rate(1.0, 6)
    );
    // A key that stopped: 0 once its packets are out of the readings kept, of which there
    // are at most `DEMAND_HISTORY` + 1.
    for t in 6..20u64 {
        sparse.push(t, 3);
    }
    assert_eq!(sparse.rate(1.0, 6), 0.0);
    assert_eq!(sparse.len(), DEMAND_HISTORY + 1);
    w.push(20, 1_000_000);
    assert!(
        (w.rate(1.0, 6) - want).abs() < 1e-9,
        "the same time again: ignored"
    );
    assert_eq!(w.last_at(), Some(20));
    // An older reading (a clock stepped back, or the readings before were not real): the
    // window starts again from it, and later readings count again (a window that ignored
    // them would keep the old rate for ever).
    w.push(15, 1_000_000);
    assert_eq!((w.len(), w.last_at(), w.rate(1.0, 6)), (1, Some(15), 0.0));
    w.push(16, 1_000_100);
    assert!((w.rate(1.0, 6) - 100.0).abs() < 1e-9);
    // A count that went back likewise.
    w.push(17, 5);
    assert_eq!((w.len(), w.rate(1.0, 6)), (1, 0.0));
}

/// A restarted peer is a new incarnation, baselined when first counted; the old one's last
/// demand stops counting once its sync key has not moved for `stale_ns` (here 300 ms), and it
/// is forgotten once gone from chitchat.
#[test]
fn a_restarted_peer_is_a_new_incarnation_and_the_old_ones_demand_goes_stale() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    t.round(0, &[view("a@1", 1, 2, &[(1, 100)])], &l);
    assert_eq!(
        per_sync(&t.round(100 * MS, &[view("a@1", 2, 2, &[(1, 200)])], &l)),
        100
    );
    // The peer restarts: generation 2 appears (baseline), generation 1's sync stops moving.
    let r = t.round(
        200 * MS,
        &[view("a@1", 2, 2, &[(1, 200)]), view("a@2", 1, 1, &[])],
        &l,
    );
    assert_eq!(
        per_sync(&r),
        100,
        "the old one's last demand, within 300 ms"
    );
    let r = t.round(
        500 * MS,
        &[
            view("a@1", 2, 2, &[(1, 200)]),
            view("a@2", 2, 2, &[(1, 40)]),
        ],
        &l,
    );
    assert_eq!(
        per_sync(&r),
        40,
        "the old one's is stale: only the new one's"
    );
    assert_eq!(r.demand[&name()], vec![("a@2".to_string(), 400.0)]);
    // The old one gone from chitchat: forgotten.
    t.round(600 * MS, &[view("a@2", 3, 2, &[(1, 60)])], &l);
    assert_eq!(t.info(600 * MS).count(), 1);
}

#[test]
fn a_silent_peer_has_no_demand_and_rejoins_from_a_new_baseline() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    t.round(0, &[view("a", 1, 2, &[(1, 0)])], &l);
    assert_eq!(
        per_sync(&t.round(100 * MS, &[view("a", 2, 2, &[(1, 100)])], &l)),
        100
    );
    // Heartbeat frozen (partition) for longer than the timeout: not counted, no demand.
    let r = t.round(3 * S + 200 * MS, &[view("a", 2, 2, &[(1, 3000)])], &l);
    assert_eq!(per_sync(&r), 0);
    assert_eq!(r.counted_peers, 0);
    let info = t.info(3 * S + 200 * MS).next().unwrap().1;
    assert!(!info.heard && !info.counted);
    // Heard again: its first fresh sync key may be a snapshot from before; the baseline is
    // taken at the second, its demand known from the third.
    for (at, hb, d) in [(4 * S, 3, 4000), (4 * S + 100 * MS, 4, 4050)] {
        assert_eq!(
            per_sync(&t.round(at, &[view("a", hb, 2, &[(1, d)])], &l)),
            0
        );
    }
    assert_eq!(
        per_sync(&t.round(4 * S + 200 * MS, &[view("a", 5, 2, &[(1, 4150)])], &l)),
        100
    );
    // Dead according to the failure detector: not counted either.
    let mut dead = view("a", 6, 2, &[(1, 4250)]);
    dead.live = false;
    assert_eq!(per_sync(&t.round(4 * S + 300 * MS, &[dead], &l)), 0);
}

/// A key older than the counting of its peer, seen late, is a baseline; keys of rules or
/// limits that are not cluster-scoped here have no demand here.
#[test]
fn keys_older_than_counting_are_baselined_and_only_cluster_limits_have_demand() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    t.round(0, &[view("a", 1, 5, &[])], &l);
    assert_eq!(
        per_sync(&t.round(100 * MS, &[view("a", 2, 5, &[(3, 100_000)])], &l)),
        0
    );
    assert_eq!(
        per_sync(&t.round(200 * MS, &[view("a", 3, 5, &[(3, 100_100)])], &l)),
        100
    );
    let other = KeyName {
        rule: "other".into(),
        ..name()
    };
    let local_limit = KeyName { limit: 1, ..name() };
    let mut v = view("a", 4, 5, &[(3, 100_200)]);
    for k in [&other, &local_limit] {
        v.keys.push((
            k.clone(),
            Count {
                epoch: 5,
                pkts: 0,
                bytes: 0,
                demand: 1_000_000,
            },
        ));
    }
    let r = t.round(300 * MS, &[v.clone()], &l);
    assert_eq!(r.keys_synced, 3);
    assert_eq!(r.demand.len(), 1, "{r:?}");
    assert_eq!(per_sync(&r), 100);
    v.heartbeat = 5;
    v.sync = Some((5, 500, 5));
    for (_, c) in &mut v.keys {
        c.demand += 100;
    }
    let r = t.round(400 * MS, &[v], &l.with("flood", 1, FLOOD));
    assert_eq!(r.demand.len(), 2, "limit 1 made cluster-scoped: {r:?}");
}

/// A counted peer holds a key once its demand for it is known, 0 included (an idle key's
/// budget is divided with it); not while the key is a baseline, not once the peer is stale
/// or no longer counted, and only keys of limits cluster-scoped here.
#[test]
fn a_peer_holds_a_key_with_a_known_demand_even_an_idle_one() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let held = |r: &Round<String>| r.hosts_holding(&name());
    // First sight: a baseline, its demand not known yet.
    let r = t.round(0, &[view("a", 1, 2, &[(1, 100)]), view("b", 1, 2, &[])], &l);
    assert_eq!(held(&r), 1);
    // Known: a sends 100 per sync; b publishes the key from its next sync on (a new key,
    // counted from zero), idle.
    let r = t.round(
        100 * MS,
        &[view("a", 2, 2, &[(1, 200)]), view("b", 2, 3, &[(2, 0)])],
        &l,
    );
    assert_eq!((held(&r), per_sync(&r)), (3, 100), "{r:?}");
    assert_eq!(r.demand[&name()].len(), 1, "only a has demand: {r:?}");
    // Both idle: both still hold it (a's demand over its last two syncs: 100 over 200 ms).
    let r = t.round(
        200 * MS,
        &[view("a", 3, 2, &[(1, 200)]), view("b", 3, 3, &[(2, 0)])],
        &l,
    );
    assert_eq!((held(&r), per_sync(&r)), (3, 50), "{r:?}");
    // b stops publishing the key; a's sync stops moving: stale after the lag allowance.
    let r = t.round(
        300 * MS,
        &[view("a", 3, 2, &[(1, 200)]), view("b", 4, 3, &[])],
        &l,
    );
    assert_eq!(held(&r), 2, "a still, within the allowance: {r:?}");
    let r = t.round(
        600 * MS + 1,
        &[view("a", 3, 2, &[(1, 200)]), view("b", 5, 3, &[])],
        &l,
    );
    assert_eq!(held(&r), 1, "a stale, b without the key: {r:?}");
    // A key of a limit not cluster-scoped here is held by nobody here.
    let other = KeyName {
        rule: "other".into(),
        ..name()
    };
    assert_eq!(r.hosts_holding(&other), 1);
    assert!(!r.holders.contains_key(&other));
}

/// A member with the key, under ten identities of its own (each counted), publishes the
/// victim's key with no demand, a source it never saw: each identity holds it, so the victim
/// keeps `1 / 11` of the rate and burst here while idle. That is less than a claim can do
/// (a claim of any demand takes the share to its floor, see the tests below), and it is no
/// throttle of a polite source: its share is never below its own demand over the rate, so
/// its bucket refills at least as fast as it sends. It ends with the publishing: the round
/// after the identities stop publishing the key, a lag allowance after they stop syncing
/// (cut off, stopped), at once when they are no longer counted.
#[test]
fn holders_without_demand_never_take_a_polite_source_below_its_demand_and_leave_with_their_syncs() {
    let l = limits();
    let ids: Vec<String> = (0..10).map(|i| format!("x{i}")).collect();
    let attackers = |seq: u64, with_key: bool, heard: bool| -> Vec<PeerView<String>> {
        ids.iter()
            .map(|id| PeerView {
                live: heard,
                ..view(id, seq, 2, if with_key { &[(1, 0)] } else { &[] })
            })
            .collect()
    };
    for end in ["unpublished", "cut off", "not counted"] {
        let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
        t.round(0, &attackers(1, false, true), &l);
        let mut r = Round::default();
        for seq in 2..=20 {
            r = t.round(seq * 100 * MS, &attackers(seq, true, true), &l);
        }
        assert_eq!(
            (r.hosts_holding(&name()), r.peer_demand(&name())),
            (11, 0.0)
        );
        let s = victim_share(&r);
        assert!((s - (200.0 + 800.0 / 11.0) / 1000.0).abs() < 1e-9, "{s}");
        assert!(s >= 0.2, "never below the victim's own demand: {s}");
        let idle = crate::cluster::shares::share(0.0, 0.0, 1.0, Some(1000.0), 11.0);
        assert!((idle - 1.0 / 11.0).abs() < 1e-9);
        // The attack ends.
        let at = |i: u64| (20 + i) * 100 * MS;
        let rounds: Vec<u32> = (1..=5)
            .map(|i| {
                let views = match end {
                    "unpublished" => attackers(20 + i, false, true),
                    "cut off" => attackers(20, true, true),
                    _ => attackers(20 + i, true, false),
                };
                t.round(at(i), &views, &l).hosts_holding(&name())
            })
            .collect();
        let expected: &[u32] = match end {
            // Stale once its sync key is more than the allowance (3 intervals) old.
            "cut off" => &[11, 11, 11, 1, 1],
            _ => &[1, 1, 1, 1, 1],
        };
        assert_eq!(rounds, expected, "{end}");
    }
}

/// A member with the key relays, under an honest member's id, a key that member never
/// published: the victim's key, idle (`1:0:0:0`). chitchat keeps it in that member's state
/// for as long as the member lives (the member never re-sets or deletes a key it does not
/// have), beside its real keys and its sync key, which keeps moving. Read as a key the
/// member holds, it kept the victim at `1 / 2` of the rate and of the burst here long after
/// the attacker had stopped (or been removed): for the member's whole life, past every bound
/// docs/cluster.md documents. A member's idle keys count as held only while its sync key names
/// exactly the keys read from it ([`PeerView::keys_attested`]).
#[test]
fn a_key_relayed_under_another_members_id_is_not_held_by_it_once_the_attacker_stops() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let other = KeyName {
        addr: IpAddr::from([198, 18, 0, 7]),
        ..name()
    };
    // The honest member `a` publishes one idle key of its own, `other`; the attacker's relay
    // added the victim's key beside it (`a` keeps publishing, its sync moving on).
    let a = |seq: u64| PeerView {
        keys: vec![
            (other.clone(), Count::parse("1:0:0:0").unwrap()),
            (name(), Count::parse("1:0:0:0").unwrap()),
        ],
        // What its sync key names: the one key it publishes.
        keys_digest: Some(keys_digest([other.to_key().as_str()])),
        ..view("a", seq, 2, &[])
    };
    t.round(0, &[a(1)], &l);
    let mut held = Vec::new();
    for seq in 2..=100u64 {
        let r = t.round(seq * 100 * MS, &[a(seq)], &l);
        held.push(r.hosts_holding(&name()));
    }
    let r = t.round(101 * 100 * MS, &[a(101)], &l);
    assert_eq!(
        (r.hosts_holding(&name()), victim_share(&r)),
        (1, 1.0),
        "10 s after the relay, the victim is held by nobody but this host: {held:?}"
    );
}

/// A peer of before demand was published (`EPOCH:PKTS:BYTES`): its admitted packets are its
/// demand.
#[test]
fn a_peer_publishing_no_demand_has_its_admissions_as_demand() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let at = |hb: u64, value: &str| PeerView {
        sync: Some((hb, hb * 100, 2)),
        keys: vec![(name(), Count::parse(value).unwrap())],
        ..view("old", hb, 2, &[])
    };
    t.round(0, &[at(1, "1:100:10000")], &l);
    let r = t.round(100 * MS, &[at(2, "1:180:18000")], &l);
    assert!((r.peer_demand(&name()) - 800.0).abs() < 1e-9, "{r:?}");
}

/// Credits add up per peer and show in `info`.
#[test]
fn credits_are_the_peers_running_totals() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    t.round(0, &[view("a", 1, 2, &[])], &limits());
    t.credit(&"a".to_string(), 5, 500);
    t.credit(&"a".to_string(), 7, 700);
    t.credit(&"nobody".to_string(), 1, 1);
    let info = t.info(0).next().unwrap().1;
    assert_eq!((info.charged_pkts, info.charged_bytes), (12, 1200));
}

/// This host's Unix clock in the tests below (ms).
const NOW_MS: u64 = 1_700_000_000_000;

/// A peer's view as gossip carries it: its sync key's value and [`name`]'s value, parsed by
/// the agent's own parsers.
fn gossiped(id: &str, hb: u64, sync: &str, count: &str) -> PeerView<String> {
    PeerView {
        id: id.to_string(),
        live: true,
        verified: true,
        heartbeat: hb,
        heard_at: None,
        sync: parse_sync(sync),
        keys_digest: parse_keys_digest(sync),
        keys: vec![(name(), Count::parse(count).unwrap())],
    }
}

/// The victim's share here (its demand here 200 pps, the limit 1,000 pps, the hosts holding
/// its key as the round counts them) in round `r`.
fn victim_share(r: &Round<String>) -> f64 {
    crate::cluster::shares::share(
        200.0,
        r.peer_demand(&name()),
        1.0,
        Some(1000.0),
        f64::from(r.hosts_holding(&name())),
    )
}

/// A member with the key (under its own id, or another's through chitchat's relaying)
/// publishes a sync key dated 10^12 ms ahead with the largest epoch, and the victim's key at
/// the largest epoch and demand. Before, that reading was taken as the newest: every real
/// reading after it looked older and was ignored, and the victim's demand read ~1.8e10 pps
/// for ever (its share at the 1 / 65,536 floor). Now it is refused (the peer is left out for
/// that round: fail open), and the peer's next real syncs count as before.
#[test]
fn a_reading_dated_ahead_is_refused_and_never_freezes_the_peers_demand() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let mut round = |at: u64, hb: u64, sync: String, count: &str| {
        t.set_clock(NOW_MS + at / MS);
        t.round(at, &[gossiped("a", hb, &sync, count)], &l)
    };
    let real = |seq: u64, at: u64, demand: u64| {
        (
            format!("{seq}:{}:2", NOW_MS + at / MS),
            format!("1:0:0:{demand}"),
        )
    };
    let (s, c) = real(1, 0, 100);
    round(0, 1, s, &c);
    let (s, c) = real(2, 100 * MS, 200);
    let r = round(100 * MS, 2, s, &c);
    assert!((r.peer_demand(&name()) - 1000.0).abs() < 1e-6, "{r:?}");
    let fair = victim_share(&r);
    assert!((fair - 200.0 / 1200.0).abs() < 1e-9);

    let forged_sync = format!("3:{}:{}", NOW_MS + 100 + 1_000_000_000_000, u64::MAX);
    let forged_key = format!("{}:0:0:{}", u64::MAX, u64::MAX);
    let r = round(200 * MS, 3, forged_sync, &forged_key);
    assert_eq!(r.refused, 1, "{r:?}");
    assert_eq!(r.counted_peers, 0, "left out for the round: fail open");
    assert_eq!(victim_share(&r), 1.0);
    // The forged key stays in the gossip state beside the peer's next real sync keys (the
    // peer republishes a key only when it changes): refused, never a mark.
    let r = round(300 * MS, 4, format!("3:{}:2", NOW_MS + 300), &forged_key);
    assert!(r.refused >= 1, "{r:?}");
    assert!(victim_share(&r) >= fair, "{r:?}");
    // The real key again: its demand counts from the next sync, as before the forgery.
    let mut shares = Vec::new();
    for (i, hb) in (5..10).enumerate() {
        let at = (400 + 100 * i as u64) * MS;
        let (s, c) = real(hb - 1, at, 300 + 100 * i as u64);
        shares.push(victim_share(&round(at, hb, s, &c)));
    }
    assert!(shares.iter().all(|s| *s >= fair - 1e-9), "{shares:?}");
    // Exact again once its demand window (`DEMAND_ROUNDS` syncs) holds only real readings.
    assert!(
        (shares[DEMAND_ROUNDS..]
            .iter()
            .all(|s| (s - fair).abs() < 1e-9)),
        "{shares:?}"
    );
}

/// Under its own id, a member publishes once a sync key the right time but the largest
/// epoch, with the victim's key at the largest epoch and demand: that round reads a huge
/// demand (a claim while it lasts), and once the real values are back the victim's share is
/// back within two rounds (before, the real epoch, older than the forged one, was ignored:
/// no demand for that key from the peer while the forged mark stood).
#[test]
fn a_forged_epoch_and_count_are_forgotten_once_the_real_ones_are_back() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let mut round = |at: u64, hb: u64, sync: String, count: String| {
        t.set_clock(NOW_MS + at / MS);
        t.round(at, &[gossiped("a", hb, &sync, &count)], &l)
    };
    let sync = |seq: u64, epoch: u64| format!("{seq}:{}:{epoch}", NOW_MS + seq * 100);
    round(100 * MS, 1, sync(1, 2), "1:0:0:100".into());
    let r = round(200 * MS, 2, sync(2, 2), "1:0:0:200".into());
    let fair = victim_share(&r);
    let r = round(
        300 * MS,
        3,
        sync(3, u64::MAX),
        format!("{}:0:0:{}", u64::MAX, u64::MAX),
    );
    assert!(victim_share(&r) < 1e-6, "the claim, while it lasts");
    let r = round(400 * MS, 4, sync(4, 2), "1:0:0:400".into());
    assert_eq!(r.refused, 1, "the epoch went back: a new baseline");
    assert_eq!(victim_share(&r), 1.0);
    let r = round(500 * MS, 5, sync(5, 2), "1:0:0:500".into());
    assert!((victim_share(&r) - fair).abs() < 1e-9, "{r:?}");
    // A sequence number run ahead, then the real ones: a new baseline, counted again after.
    round(
        600 * MS,
        6,
        format!("{}:{}:2", u64::MAX, NOW_MS + 600),
        "1:0:0:600".into(),
    );
    let r = round(700 * MS, 7, sync(7, 2), "1:0:0:700".into());
    assert_eq!(r.refused, 1, "{r:?}");
    let r = round(800 * MS, 8, sync(8, 2), "1:0:0:800".into());
    assert!((victim_share(&r) - fair).abs() < 1e-9, "{r:?}");
}

/// A member with the key pushes another member's heartbeat in chitchat far ahead (a digest
/// naming it with a huge heartbeat): its real heartbeats then look old and chitchat's
/// failure detector stops hearing it. While authentic datagrams sealed by that member keep
/// coming from its address (`direct`), it stays heard and counted here; without them it is
/// not heard past the timeout, as before.
#[test]
fn a_peer_heard_directly_stays_counted_whatever_its_heartbeat_in_chitchat() {
    let mut t = RemoteTracker::new(3 * S, LAG, SPAN);
    let l = limits();
    let frozen = |seq: u64, d: u64, direct: bool| PeerView {
        heartbeat: 1 << 40,
        heard_at: direct.then_some(seq * 100 * MS),
        sync: Some((seq, seq * 100, 2)),
        ..view("a", seq, 2, &[(1, d)])
    };
    t.round(0, &[frozen(1, 0, true)], &l);
    for i in 2..=50u64 {
        let r = t.round(i * 100 * MS, &[frozen(i, 100 * (i - 1), true)], &l);
        assert_eq!((r.counted_peers, per_sync(&r)), (1, 100), "round {i}");
    }
    assert!(t.heard(&"a".to_string(), 1 << 40, 5 * S + 3 * S));
    // No authentic datagram from it since 5 s: not heard once the timeout has passed since
    // that one (not a timeout after it was last seen as recent).
    let r = t.round(8 * S, &[frozen(51, 5000, false)], &l);
    assert_eq!(
        r.counted_peers, 1,
        "within the timeout of its last datagram"
    );
    let r = t.round(8 * S + 1, &[frozen(51, 5000, false)], &l);
    assert_eq!(r.counted_peers, 0);
}

/// An on/off source at one host: 100 packets an interval for 3 sync intervals, then 4 silent
/// (cycle 700 ms at 100 ms), read by the host at every sync and by a peer whose gossip skipped
/// every third one (never two in a row, as gossip brings the next). Over the same span of
/// time the two read the same at every reading the peer got, 333-500 pps (the count at the
/// span's start read between the peer's readings around it). Over the 7 readings it keeps,
/// 9 intervals, the peer read 333-556 where the host read 333-500, 1.33x on average while the
/// source sent, and 16 hosts' shares added up to less than 1 while it sent (docs/cluster.md,
/// "Accuracy").
#[test]
fn a_peer_that_missed_syncs_reads_a_bursty_key_over_the_hosts_span() {
    let count = |j: u64| (0..j).filter(|i| i % 7 < 3).count() as u64 * 100;
    let (mut host, mut peer) = (DemandWindow::default(), DemandWindow::default());
    let mut compared = 0;
    for j in 0..80u64 {
        let t = j * 100 * MS;
        host.push(t, count(j));
        if j % 3 == 1 {
            continue;
        }
        peer.push(t, count(j));
        if j < 14 {
            continue;
        }
        let (h, p) = (host.rate(1e9, SPAN), peer.rate(1e9, SPAN));
        assert!(
            (h - p).abs() < 1e-6 && (300.0..=500.0 + 1e-6).contains(&h),
            "at {j}00 ms the host read {h:.1} pps, its peer {p:.1}"
        );
        compared += 1;
    }
    assert_eq!(compared, 44);
}
