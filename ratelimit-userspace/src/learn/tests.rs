//! The learner's sketches, windows, state file and proposals, on synthetic buckets and clocks.

use ratelimit_common::{bucket_rule, family, Bucket};

use super::{
    heavy::{Heavy, Source, Top, HEAVY_K},
    history::{History, DAY_SECS, HOUR_SECS, SLOT_SECS},
    persist,
    suggest::{parse_since, suggest, Query, TCP_BURST_SECS},
    track::Observation,
    track::{Tracker, MAX_TRACKED},
    Learner, MAX_LIMITS,
};
use crate::{
    compile::{compile, CompiledRuleSet, RuleIds},
    config::Config,
};

const S: u64 = 1_000_000_000;

fn set(toml: &str) -> CompiledRuleSet {
    let c = Config::parse(toml, "test.toml").unwrap();
    compile(&c.rules, &RuleIds::new()).unwrap()
}

fn bucket(id: u32, limit: u32, src: u32, created: u64, pkts: u32) -> Bucket {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&src.to_be_bytes());
    Bucket {
        addr,
        rule: u16::try_from(bucket_rule(id, limit)).unwrap(),
        family: family::V4,
        created_share: Bucket::created_at(created),
        passed_pkts: pkts,
        ..Bucket::default()
    }
}

/// The key of source `i`, 198.18.0.0/15 counted from 198.18.0.1, as a /32.
fn src(i: u32) -> Source {
    let ip = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(198, 18, 0, 1)) + i);
    Source(Some(ipnet::IpNet::from(std::net::IpAddr::V4(ip))))
}

fn obs(rate: f64) -> Observation {
    Observation {
        peak_1s: rate * 1.2,
        peak_10s: rate,
        burst: rate * 0.05,
    }
}

/// A deterministic log-normal population of `n` rates (median `median`, sigma 1).
fn lognormal(n: usize, median: f64, mut x: u64) -> Vec<f64> {
    let mut uniform = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        #[expect(clippy::cast_precision_loss, reason = "a uniform draw")]
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        u.max(1e-12)
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (uniform(), uniform());
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            median * z.exp()
        })
        .collect()
}

fn true_quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "an index"
    )]
    let i = ((q * (s.len() - 1) as f64).round() as usize).min(s.len() - 1);
    s[i]
}

/// A constant-rate bucket followed for 15 s of 1 s walks shows its rate as its 10 s and 1 s
/// peaks; one sending in bursts shows a 1 s peak above its 10 s one, the excess as its burst.
#[test]
fn a_bucket_s_peaks_and_burst_come_from_its_counters() {
    let mut t = Tracker::new();
    let mut gone = |_: &ratelimit_common::BucketKey, _: Observation| panic!("nothing goes");
    for s in 0..=15u32 {
        t.begin();
        t.read(0, &bucket(1, 0, 1, 0, 100 * s), u64::from(s) * S, &mut gone);
        // 1,000 packets in second 7 only, else nothing.
        let b = if s < 7 { 0 } else { 1000 };
        t.read(1, &bucket(1, 0, 2, 0, b), u64::from(s) * S, &mut gone);
        t.end(&mut gone);
    }
    let mut seen = Vec::new();
    t.live(false, &mut |_, o| seen.push(o));
    seen.sort_by(|a, b| a.peak_1s.total_cmp(&b.peak_1s));
    let [steady, bursty] = seen[..] else {
        panic!("{seen:?}")
    };
    assert!((steady.peak_10s - 100.0).abs() < 1e-6, "{steady:?}");
    assert!((steady.peak_1s - 100.0).abs() < 1e-6, "{steady:?}");
    assert!(steady.burst.abs() < 1e-6, "{steady:?}");
    assert!((bursty.peak_10s - 100.0).abs() < 1e-6, "{bursty:?}");
    assert!((bursty.peak_1s - 1000.0).abs() < 1e-6, "{bursty:?}");
    assert!((bursty.burst - 900.0).abs() < 1e-6, "{bursty:?}");
}

/// A record taken by another key (an eviction) ends the first bucket: its observation goes to
/// its rule at once, and the new one starts from its own counters.
#[test]
fn a_bucket_evicted_is_observed_as_it_goes() {
    let mut t = Tracker::new();
    let mut out = Vec::new();
    for s in 0..=3u32 {
        t.begin();
        t.read(
            5,
            &bucket(1, 0, 1, 0, 50 * s),
            u64::from(s) * S,
            &mut |w, o| {
                out.push((*w, o));
            },
        );
        t.end(&mut |w, o| out.push((*w, o)));
    }
    t.begin();
    t.read(5, &bucket(2, 0, 9, 4 * S, 7), 4 * S, &mut |w, o| {
        out.push((*w, o))
    });
    t.end(&mut |w, o| out.push((*w, o)));
    assert_eq!(out.len(), 1, "{out:?}");
    // 150 packets over a 10 s window that it did not live out: 15/s.
    assert!((out[0].1.peak_10s - 15.0).abs() < 1e-6, "{out:?}");
    assert!((out[0].1.peak_1s - 50.0).abs() < 1e-6, "{out:?}");
    assert_eq!(t.len(), 1);
}

/// Past [`MAX_TRACKED`] records, the tracker samples: it never follows more.
#[test]
fn the_followed_set_is_bounded_whatever_the_number_of_sources() {
    let mut t = Tracker::new();
    let n = u32::try_from(MAX_TRACKED).unwrap() * 3;
    t.begin();
    for i in 0..n {
        t.read(i, &bucket(1, 0, i, 0, 1), 0, &mut |_, _| {});
    }
    t.end(&mut |_, _| {});
    assert!(t.len() <= MAX_TRACKED, "{} followed", t.len());
    assert!(t.len() > MAX_TRACKED / 4, "{} followed", t.len());
    assert!(t.sampled() < 0.5, "sampled {}", t.sampled());
}

/// Slots of the last hour become hours, hours older than a day go; `since` picks the slots.
#[test]
fn history_keeps_an_hour_by_slot_and_a_day_by_hour() {
    let mut h = History::default();
    let t0 = 10 * DAY_SECS;
    h.add(t0, &obs(10.0), src(1));
    h.add(t0 + SLOT_SECS, &obs(20.0), src(2));
    h.add(t0 + 2 * HOUR_SECS, &obs(30.0), src(3));
    assert_eq!(h.since(t0 + 2 * HOUR_SECS, HOUR_SECS).count(), 1);
    assert_eq!(h.since(t0 + 2 * HOUR_SECS, DAY_SECS).count(), 3);
    assert_eq!(h.hours.len(), 1, "the first hour's two slots, merged");
    h.roll(t0 + 2 * HOUR_SECS + DAY_SECS + HOUR_SECS);
    assert_eq!(h.since(t0 + 3 * DAY_SECS, DAY_SECS).count(), 0);
    assert!(h.hours.is_empty() && h.recent.len() <= 1);
}

fn heavy(i: u32, peak_1s: f64, peak_10s: f64, burst: f64) -> Heavy {
    Heavy {
        source: src(i),
        peak_1s,
        peak_10s,
        burst,
    }
}

/// A list keeps the [`HEAVY_K`] heaviest by 1 s peak, heaviest first, whatever the order they
/// come in; a source seen again keeps its highest figures, each on its own; a bucket that sent
/// nothing over a second is not named.
#[test]
fn a_heavy_list_keeps_the_k_heaviest_one_entry_a_source() {
    let mut t = Top::default();
    // 200 sources in a scrambled order, source i at 1 s peak i + 1.
    for k in 0..200u32 {
        let i = (k * 77) % 200;
        t.add(heavy(i, f64::from(i + 1), 1.0, 0.0));
    }
    t.add(heavy(500, 0.0, 0.0, 0.0));
    assert_eq!(t.len(), HEAVY_K);
    let names: Vec<Source> = t.entries().iter().map(|h| h.source).collect();
    let want: Vec<Source> = (0..HEAVY_K as u32).map(|k| src(199 - k)).collect();
    assert_eq!(names, want);
    // Source 190 again: a lower 1 s peak, a higher 10 s peak and burst.
    t.add(heavy(190, 50.0, 120.0, 30.0));
    let e = t.entries().iter().find(|h| h.source == src(190)).unwrap();
    assert_eq!((e.peak_1s, e.peak_10s, e.burst), (191.0, 120.0, 30.0));
    assert_eq!(t.len(), HEAVY_K);
    // Lighter than the lightest: not named, and nothing goes.
    t.add(heavy(900, 10.0, 10.0, 0.0));
    assert!(t.entries().iter().all(|h| h.source != src(900)));
    assert_eq!(t.entries().last().unwrap().source, src(184));
}

/// Merging lists (slots into an hour, hours into a day) gives the [`HEAVY_K`] heaviest of the
/// union, each source once with its highest figures: the same as one list fed every
/// observation.
#[test]
fn heavy_lists_merge_into_the_heaviest_of_the_union() {
    let rates = lognormal(600, 40.0, 11);
    let mut parts = vec![Top::default(); 6];
    let mut whole = Top::default();
    for (k, r) in rates.iter().enumerate() {
        // 100 sources, each in several parts with different figures.
        let h = heavy(u32::try_from(k % 100).unwrap(), *r, r / 2.0, r / 10.0);
        parts[k % 6].add(h);
        whole.add(h);
    }
    let mut merged = Top::default();
    for p in &parts {
        merged.merge(p);
    }
    assert_eq!(merged, whole);
    assert_eq!(merged.len(), HEAVY_K);
    // Through the history: slots of the last hour become an hour of the day, and `since` over
    // the day merges hours and slots alike.
    let mut h = History::default();
    let t0 = 10 * DAY_SECS;
    for (k, r) in rates.iter().enumerate() {
        let at = t0 + (k as u64 % 6) * 20 * 60;
        h.add(at, &obs(*r), src(u32::try_from(k % 100).unwrap()));
    }
    h.roll(t0 + 3 * HOUR_SECS);
    assert!(!h.hours.is_empty());
    let day = h.since(t0 + 3 * HOUR_SECS, DAY_SECS);
    let names: Vec<Source> = day.heavy.entries().iter().map(|e| e.source).collect();
    let want: Vec<Source> = whole.entries().iter().map(|e| e.source).collect();
    assert_eq!(names, want);
}

/// Whether two lists name the same sources in the same order with the same figures (to the
/// last digits JSON keeps).
fn same_heavy(a: &Top, b: &Top) -> bool {
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * x.abs().max(1.0);
    a.len() == b.len()
        && a.entries().iter().zip(b.entries()).all(|(x, y)| {
            x.source == y.source
                && close(x.peak_1s, y.peak_1s)
                && close(x.peak_10s, y.peak_10s)
                && close(x.burst, y.burst)
        })
}

/// The state file reads back what was written: the same quantiles and the same heaviest
/// buckets (an IPv4 source, an IPv6 prefix, a rule's one bucket), slot by slot.
#[test]
fn the_state_file_reads_back_what_was_written() {
    let mut all = persist::Histories::new();
    let now = 100 * DAY_SECS + 123;
    let mut h = History::default();
    for (i, r) in lognormal(500, 50.0, 7).into_iter().enumerate() {
        h.add(
            now - 2 * HOUR_SECS + (i as u64) * 10,
            &obs(r),
            src(i as u32),
        );
    }
    let v6 = Source(Some("2001:db8:7::/48".parse().unwrap()));
    h.add(now - HOUR_SECS, &obs(9_000.0), v6);
    h.add(now, &obs(7_000.0), Source(None));
    all.insert(("web".into(), 2), h.clone());
    let bytes = persist::encode(&all, now);
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.contains("\"source\":\"2001:db8:7::/48\""), "{text}");
    assert!(text.contains("\"source\":\"*\""), "{text}");
    let back = persist::decode(&bytes, now, MAX_LIMITS).unwrap();
    let got = &back[&("web".to_owned(), 2)];
    for since in [HOUR_SECS, DAY_SECS] {
        let (a, b) = (h.since(now, since), got.since(now, since));
        assert_eq!(a.count(), b.count());
        for q in [0.5, 0.9, 0.99] {
            assert_eq!(
                a.peak_10s.quantile(q).unwrap(),
                b.peak_10s.quantile(q).unwrap()
            );
        }
        assert_eq!(a.heavy.len(), HEAVY_K);
        assert!(
            same_heavy(&a.heavy, &b.heavy),
            "{:?}\n{:?}",
            a.heavy,
            b.heavy
        );
    }
    let day = got.since(now, DAY_SECS);
    assert_eq!(day.heavy.entries()[0].source, v6);
    assert_eq!(day.heavy.entries()[1].source, Source(None));
}

/// A version 1 file (written before the heaviest buckets were kept) reads back as the history
/// it holds, naming no bucket: an upgrade keeps what was learned. Refusing it would drop up to
/// a day of history for want of a list that fills again in five minutes.
#[test]
fn a_version_1_file_reads_back_without_heaviest_buckets() {
    let now = 100 * DAY_SECS + 123;
    let mut h = History::default();
    for (i, r) in lognormal(200, 50.0, 3).into_iter().enumerate() {
        h.add(
            now - 3 * HOUR_SECS + (i as u64) * 30,
            &obs(r),
            src(i as u32),
        );
    }
    let mut all = persist::Histories::new();
    all.insert(("web".into(), 1), h.clone());
    // Version 1 as it was written: the same but for the version and the slots' `heavy`.
    let mut v: serde_json::Value = serde_json::from_slice(&persist::encode(&all, now)).unwrap();
    assert_eq!(v["version"], persist::VERSION);
    v["version"] = 1.into();
    for slot in v["limits"][0]["slots"].as_array_mut().unwrap() {
        assert!(slot.as_object_mut().unwrap().remove("heavy").is_some());
    }
    let v1 = serde_json::to_vec(&v).unwrap();
    let back = persist::decode(&v1, now, MAX_LIMITS).unwrap();
    let got = &back[&("web".to_owned(), 1)];
    let (a, b) = (h.since(now, DAY_SECS), got.since(now, DAY_SECS));
    assert_eq!(a.count(), b.count());
    assert_eq!(
        a.peak_10s.quantile(0.9).unwrap(),
        b.peak_10s.quantile(0.9).unwrap()
    );
    assert!(b.heavy.is_empty(), "{:?}", b.heavy);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(persist::path(dir.path()), &v1).unwrap();
    assert_eq!(Learner::new(Some(dir.path().to_path_buf())).limits(), 1);
}

/// A file that is not whole JSON, of another version, or whose sketch does not decode is
/// refused with the reason; the learner then starts with no history.
#[test]
fn a_corrupt_or_unknown_version_file_is_refused_and_the_learner_starts_fresh() {
    let now = 100 * DAY_SECS;
    let mut all = persist::Histories::new();
    let mut h = History::default();
    h.add(now, &obs(5.0), src(1));
    all.insert(("web".into(), 1), h);
    let good = persist::encode(&all, now);
    let text = String::from_utf8(good.clone()).unwrap();

    let cut = persist::decode(&good[..good.len() / 2], now, MAX_LIMITS).unwrap_err();
    assert!(cut.contains("not a learned-state file"), "{cut}");
    let v3 = text.replacen("\"version\":2", "\"version\":3", 1);
    let err = persist::decode(v3.as_bytes(), now, MAX_LIMITS).unwrap_err();
    assert!(err.contains("version 3"), "{err}");
    let v0 = text.replacen("\"version\":2", "\"version\":0", 1);
    assert!(persist::decode(v0.as_bytes(), now, MAX_LIMITS).is_err());
    let i = text.find("\"peak_10s\":\"").unwrap() + 12;
    let mut bad = text.clone();
    bad.replace_range(i..i + 4, "zz00");
    assert!(persist::decode(bad.as_bytes(), now, MAX_LIMITS).is_err());
    let long = text.replacen("\"limit\":1", "\"limit\":9", 1);
    assert!(persist::decode(long.as_bytes(), now, MAX_LIMITS).is_err());
    // A heavy bucket whose source is no prefix, whose figure is negative, or a list longer than
    // a list holds.
    let named = "\"source\":\"198.18.0.2/32\"";
    assert!(text.contains(named), "{text}");
    let not_addr = text.replacen(named, "\"source\":\"198.18.0.300\"", 1);
    let err = persist::decode(not_addr.as_bytes(), now, MAX_LIMITS).unwrap_err();
    assert!(err.contains("198.18.0.300"), "{err}");
    let negative = text.replacen("\"burst\":0.25", "\"burst\":-1.0", 1);
    assert_ne!(negative, text);
    assert!(persist::decode(negative.as_bytes(), now, MAX_LIMITS).is_err());
    let one = &text[text.find("{\"source\"").unwrap()..text.find("}]").unwrap() + 1];
    let many = vec![one; HEAVY_K + 1].join(",");
    let long_list = text.replacen(one, &many, 1);
    let err = persist::decode(long_list.as_bytes(), now, MAX_LIMITS).unwrap_err();
    assert!(err.contains("buckets"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(persist::path(dir.path()), v3).unwrap();
    let err = persist::read(dir.path(), now, MAX_LIMITS).unwrap_err();
    assert!(err.contains("version"), "{err}");
    let learner = Learner::new(Some(dir.path().to_path_buf()));
    assert_eq!(learner.limits(), 0);
    std::fs::write(persist::path(dir.path()), b"\x00\xffgarbage").unwrap();
    assert_eq!(Learner::new(Some(dir.path().to_path_buf())).limits(), 0);
}

/// The write goes through a temporary file renamed over the old one: the file is whole
/// afterwards, nothing else is left in the directory, and it is created (0700) if missing.
#[test]
fn the_state_file_is_written_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    persist::write_atomic(&state, b"{\"version\":1,\"saved_unix\":0,\"limits\":[]}").unwrap();
    persist::write_atomic(&state, b"{\"version\":1,\"saved_unix\":1,\"limits\":[]}").unwrap();
    let names: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec![persist::FILE.to_owned()]);
    assert!(persist::read(&state, 10, MAX_LIMITS)
        .unwrap()
        .unwrap()
        .is_empty());
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&state).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
}

/// Over a log-normal population with a few heavy hitters, the proposed rate is the quantile
/// asked of the sources' 10 s peaks (within the sketch's 2%) times the headroom, and the
/// proposal says how many sources it would have limited.
#[test]
fn the_proposal_is_the_quantile_times_the_headroom() {
    let mut rates = lognormal(1000, 40.0, 99);
    rates.extend([5_000.0, 8_000.0, 12_000.0]);
    let mut h = History::default();
    let now = 50 * DAY_SECS;
    for (i, r) in rates.iter().enumerate() {
        h.add(now, &obs(*r), src(i as u32));
    }
    let q = Query {
        rule: None,
        quantile: 0.9,
        headroom: 1.0,
        since_secs: HOUR_SECS,
    };
    let s = suggest(("web", 1), &h.since(now, HOUR_SECS), &q, (1.0, false, None));
    let want = true_quantile(&rates, 0.9);
    #[expect(clippy::cast_precision_loss, reason = "a rate")]
    let got = s.proposed.rate as f64;
    assert!(
        (got - want).abs() / want < 0.05,
        "rate {got}, true 0.9 quantile {want}"
    );
    assert_eq!(s.sources, 1003);
    assert!(
        (90..=110).contains(&s.effect.limited_sources),
        "{:?}",
        s.effect
    );
    assert!(s.effect.limited_share > 0.0 && s.effect.limited_share < 1.0);
    let binned = s.histogram.iter().map(|b| b.sources).sum::<u64>();
    assert!((1000..=1006).contains(&binned), "{binned} in the histogram");
    // The heaviest it would have limited: the three heavy hitters first, heaviest first, then
    // the heaviest of the rest, as many as a list holds (all of them above the rate).
    let named: Vec<Source> = s.effect.limited_heaviest.iter().map(|h| h.source).collect();
    assert_eq!(named.len(), HEAVY_K, "{named:?}");
    assert_eq!(named[..3], [src(1002), src(1001), src(1000)]);
    assert!((s.effect.limited_heaviest[0].peak_10s - 12_000.0).abs() < 1e-6);
    // TCP: the burst is at least 0.2 s of the rate, and it says why.
    let tcp = suggest(("web", 1), &h.since(now, HOUR_SECS), &q, (1.0, true, None));
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "packets"
    )]
    let floor = (tcp.proposed.rate as f64 * TCP_BURST_SECS).ceil() as u64;
    assert!(tcp.proposed.burst >= floor, "{:?}", tcp.proposed);
    assert!(
        tcp.reasons.iter().any(|r| r.contains("TCP")),
        "{:?}",
        tcp.reasons
    );
}

/// On a small population the effect counts every source above the rate and the histogram
/// every source: 20 sources of 10 s peaks 10, 20, ... 200 under their 0.9 quantile (headroom
/// 1.0: the 18th, 180/s within the sketch's 2%) limit exactly the two above it, and the ten bins
/// hold 20. (The rank was the quantile's own argument: 1 source here, 0 for a rate between the
/// two largest, and 19 in the histogram.)
#[test]
fn a_small_population_s_effect_counts_every_source_above_the_rate() {
    let mut h = History::default();
    let now = 50 * DAY_SECS;
    for k in 1..=20u32 {
        h.add(now, &obs(f64::from(k * 10)), src(k));
    }
    let q = Query {
        rule: None,
        quantile: 0.9,
        headroom: 1.0,
        since_secs: HOUR_SECS,
    };
    let s = suggest(("web", 1), &h.since(now, HOUR_SECS), &q, (1.0, false, None));
    assert!((176..=184).contains(&s.proposed.rate), "{:?}", s.proposed);
    assert_eq!(s.effect.limited_sources, 2, "{:?}", s.effect);
    // Named: those above the rate, and those whose busiest second (1.2 x their rate) is above
    // rate + burst: 170/s, under the rate, sent 204 in a second, over at most 184 + 10.
    #[expect(clippy::cast_precision_loss, reason = "a rate and a burst")]
    let (rate, burst) = (s.proposed.rate as f64, s.proposed.burst as f64);
    let want: Vec<Source> = (1..=20u32)
        .rev()
        .filter(|&k| f64::from(k * 10) > rate || f64::from(k * 12) > rate + burst)
        .map(src)
        .collect();
    let named: Vec<Source> = s.effect.limited_heaviest.iter().map(|h| h.source).collect();
    assert_eq!(named, want, "{:?}", s.proposed);
    assert_eq!(named[..2], [src(20), src(19)]);
    assert!(named.contains(&src(17)), "{named:?}");
    let binned = s.histogram.iter().map(|b| b.sources).sum::<u64>();
    assert_eq!(binned, 20, "{:?}", s.histogram);
    let all = Query {
        quantile: 1.0,
        headroom: 1.5,
        ..q
    };
    let none = suggest(
        ("web", 1),
        &h.since(now, HOUR_SECS),
        &all,
        (1.0, false, None),
    );
    assert_eq!(none.effect.limited_sources, 0, "{:?}", none.effect);
    assert!(none.effect.limited_heaviest.is_empty(), "{:?}", none.effect);
}

/// The learner end to end on a synthetic store: buckets of two limits of a rule, walked once a
/// second, give a suggestion per limit; a rule not in force is refused by name.
#[test]
fn the_learner_suggests_per_rule_and_limit() {
    let set = set(
        "[[rule]]\nname = \"web\"\nsource = \"10.0.0.0/8\"\nprotocol = \"tcp\"\nrate = 100\n\
         [[rule.limit]]\nper = \"/24\"\nrate = 1000\n",
    );
    let id = set.by_name("web").unwrap().id;
    let mut l = Learner::new(None);
    let unix = 1000 * SLOT_SECS + 10;
    for s in 0..=12u32 {
        let records: Vec<(u32, Bucket)> = (0..20u32)
            .map(|i| (i, bucket(id, i % 2, i, 0, (i + 1) * 10 * s)))
            .collect();
        l.walk(
            |each| {
                for (i, b) in &records {
                    each(*i, b);
                }
            },
            u64::from(s) * S,
            unix + u64::from(s),
            &set,
        );
    }
    let q = Query {
        rule: None,
        quantile: 1.0,
        headroom: 1.0,
        since_secs: HOUR_SECS,
    };
    let out = l.suggest(&set, &q).unwrap();
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!((out[0].rule.as_str(), out[0].limit), ("web", 1));
    assert_eq!(out[1].limit, 2);
    assert_eq!(out[0].sources, 10);
    // Limit 1 holds the even records: the busiest sends 190/s.
    assert!(
        (out[0].proposed.rate as i64 - 190).abs() <= 4,
        "{:?}",
        out[0]
    );
    assert!(out[0].tcp);
    assert_eq!(out[0].current.map(|c| c.rate), Some(100));
    // At the median, the heaviest limited are named by their keys: the source of limit 1 (per
    // source, /32), the /24 of limit 2 (every odd record here is of 0.0.0.0/24: one entry).
    let median = Query {
        quantile: 0.5,
        ..q.clone()
    };
    let out = l.suggest(&set, &median).unwrap();
    let names = |s: &super::suggest::Suggestion| -> Vec<String> {
        let h = &s.effect.limited_heaviest;
        h.iter().map(|h| h.source.to_string()).collect()
    };
    assert_eq!(names(&out[0])[..2], ["0.0.0.18/32", "0.0.0.16/32"]);
    assert_eq!(names(&out[1]), ["0.0.0.0/24"]);
    let missing = Query {
        rule: Some("nope".into()),
        ..q
    };
    assert!(l.suggest(&set, &missing).unwrap_err().contains("nope"));
}

/// `--since` takes units and sums them, at most a day; the API's checks name the argument.
#[test]
fn suggest_arguments_are_checked() {
    assert_eq!(parse_since("90s"), Ok(90));
    assert_eq!(parse_since("1h30m"), Ok(5400));
    assert_eq!(parse_since("1d"), Ok(86_400));
    for bad in ["", "0s", "h", "10", "2d", "5x", "-1h"] {
        assert!(parse_since(bad).is_err(), "{bad:?}");
    }
    let check = crate::api::suggest_query;
    assert!(check(None, None, None, None).is_ok());
    for (q, h, s, what) in [
        (Some("0"), None, None, "quantile"),
        (Some("1.5"), None, None, "quantile"),
        (Some("x"), None, None, "quantile"),
        (Some("NaN"), None, None, "quantile"),
        (None, Some("0.9"), None, "headroom"),
        (None, None, Some("0"), "since_secs"),
        (None, None, Some("86401"), "since_secs"),
    ] {
        let err = check(None, q, h, s).unwrap_err();
        assert!(err.starts_with(what), "{err}");
    }
    assert!(check(Some("bad name!"), None, None, None)
        .unwrap_err()
        .starts_with("rule"));
    assert!(check(None, Some("1"), Some("1"), Some("86400")).is_ok());
}

/// A million sources under 70 rules, walked for a day and an hour (an hour a walk, then five
/// minutes a walk), their rates spread over nine decades so that every sketch spreads over as
/// many bins as it can, a fifth of them gone in each walk and back in the next (so the followed
/// set's table fills with the tombstones of removed entries): the learner follows at most
/// [`MAX_TRACKED`] of them (a 1-in-64 sample) in a table of at most 2^16 slots,
/// learns at most [`MAX_LIMITS`] limits of at most 39 slots, and its sketches stay within the
/// value range's bins, whatever the number of sources. The bounds asserted are the module's
/// (its top): what it counts, not what the allocator was asked.
#[test]
fn a_million_sources_keep_the_learner_within_its_bounds() {
    const SOURCES: u32 = 1 << 20;
    const RULES: u32 = 70;
    let toml: String = (0..RULES)
        .map(|k| format!("[[rule]]\nname = \"r{k}\"\nsource = \"10.{k}.0.0/16\"\nrate = 100\n"))
        .collect();
    let set = set(&toml);
    let ids: Vec<u32> = (0..RULES)
        .map(|k| set.by_name(&format!("r{k}")).unwrap().id)
        .collect();
    let mut l = Learner::new(None);
    let t0 = 1000 * DAY_SECS;
    let steps = (0..27u64)
        .map(|h| h * HOUR_SECS)
        .chain((1..=14).map(|k| 26 * HOUR_SECS + k * SLOT_SECS));
    let mut most = super::Footprint {
        followed: 0,
        followed_bytes: 0,
        limits: 0,
        slots: 0,
        bins: 0,
        heavy: 0,
    };
    for (w, at) in steps.enumerate() {
        let w = u32::try_from(w).unwrap();
        l.walk(
            |each| {
                for i in (0..SOURCES).filter(|i| (i + w) % 5 != 0) {
                    // 2^0 to 2^30 packets a walk: from under 0.001/s to 10^6/s.
                    let step = (1u32 << (i % 31)) | (i % 7);
                    let b = bucket(ids[(i % RULES) as usize], 0, i, 0, step.wrapping_mul(w));
                    each(i, &b);
                }
            },
            (t0 + at) * S,
            t0 + at,
            &set,
        );
        let f = l.footprint();
        most = super::Footprint {
            followed: most.followed.max(f.followed),
            followed_bytes: most.followed_bytes.max(f.followed_bytes),
            limits: most.limits.max(f.limits),
            slots: most.slots.max(f.slots),
            bins: most.bins.max(f.bins),
            heavy: most.heavy.max(f.heavy),
        };
    }
    eprintln!("at most: {most:?}");
    assert!(most.followed <= MAX_TRACKED, "{most:?}");
    assert!(
        most.followed >= MAX_TRACKED / 4,
        "a 1-in-64 sample: {most:?}"
    );
    // The followed set's table: 2^16 slots of 121 bytes at most, 7.6 MiB (2^17 slots, 15.1 MiB,
    // with 65,536 followed).
    assert!(most.followed_bytes <= (1 << 16) * 121, "{most:?}");
    assert_eq!(most.limits, MAX_LIMITS, "{most:?}");
    assert!(most.slots <= MAX_LIMITS * 39, "{most:?}");
    // Deterministic: 1,388 slots, 21.7 a limit (a slot begins when a bucket's observation comes
    // after the current one ended).
    assert!(
        most.slots >= MAX_LIMITS * 12,
        "more than an hour of slots: {most:?}"
    );
    // 640 bins a sketch at most (10^11 of range in bins of 2%), three a slot.
    assert!(most.bins <= most.slots * 3 * 640, "{most:?}");
    let sketch_bytes = most.bins * 8;
    assert!(sketch_bytes <= 40 << 20, "{sketch_bytes} bytes of bins");
    // The heaviest lists: at most HEAVY_K a slot, and full ones here (thousands of sources a
    // limit).
    assert!(most.heavy <= most.slots * HEAVY_K, "{most:?}");
    assert!(most.heavy >= most.slots * HEAVY_K / 2, "{most:?}");
    let heavy_bytes = most.heavy * super::heavy::HEAVY_BYTES;
    assert!(
        heavy_bytes <= 2 << 20,
        "{heavy_bytes} bytes of heaviest lists"
    );
}
