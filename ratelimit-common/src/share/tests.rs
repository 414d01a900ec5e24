//! The share arithmetic's tests: the step and the batch, conversions, capacities.
use super::*;

const MS: u64 = 1_000_000;

/// One GCRA step as the program takes it: its `normalize` ([`base`]), then [`step`].
fn charge(
    old: u64,
    (now, floor): (u64, u64),
    cost: u64,
    tolerance: u64,
    dom: Domain,
) -> Result<u64, u64> {
    step(base(old, now, dom), (now, floor), cost, tolerance, dom)
}

#[test]
fn the_mark_is_set_only_at_a_share_in_force() {
    for word in [0u64, 1, 2, 0xffff] {
        for in_force in [false, true] {
            for cluster in [false, true] {
                let dom = domain(cluster, word, in_force);
                assert_eq!(mark(dom), u64::from(charged_word(dom) != 0), "{dom:#x}");
                assert_eq!(marked(dom), u64::from(cluster), "{dom:#x}");
                assert_eq!(
                    seal(10, dom) & STRETCHED,
                    if cluster { mark(dom) } else { 0 }
                );
            }
        }
    }
}

#[test]
fn mul_sat_saturates_and_is_exact_below() {
    for (a, b) in [
        (0u64, 5u64),
        (3, 1 << 40),
        (1 << 31, 1 << 33),
        (u64::MAX, 1),
        (1 << 33, 1 << 33),
        (12_345_678_901, 65_536),
    ] {
        let want = u128::from(a) * u128::from(b);
        let got = mul_sat(a, b);
        if want > u128::from(u64::MAX) {
            assert_eq!(got, u64::MAX, "{a} x {b}");
        } else {
            assert_eq!(u128::from(got), want, "{a} x {b}");
        }
    }
}

#[test]
fn rescale_is_the_exact_ratio_rounded_up() {
    for d in [0u64, 1, 7, 999_999, 3_600_000_000_000, 1 << 40] {
        for (from, to) in [
            (1u64, 65_536u64),
            (65_536, 1),
            (3, 7),
            (32_768, 65_535),
            (5, 5),
        ] {
            let want = (u128::from(d) * u128::from(from)).div_ceil(u128::from(to));
            assert_eq!(
                u128::from(rescale(d, from, to)),
                want,
                "{d} x {from} / {to}"
            );
        }
    }
}

/// A bucket at share `s` among `h` holders holds the whole burst, or `h x s` bursts if
/// more: that many packets conform from full, the next does not; and it refills at its
/// share.
#[test]
fn a_share_holds_its_holders_times_its_share_of_bursts_and_refills_at_it() {
    let (interval, burst) = (MS, 100u64);
    for (word, h) in [
        (1u64, 1u64),
        (3, 8),
        (655, 8),
        (6_554, 10),
        (32_768, 2),
        (45_875, 3),
        (65_535, 1),
        (65_535, 63),
    ] {
        let dom = domain(true, field(word, h), true);
        let c = cost(interval, dom);
        let tol = pkt_tolerance(burst * interval, interval, c, dom);
        let now = 10_000_000 * MS;
        let mut tat = 0;
        let mut admitted = 0u64;
        while let Ok(t) = charge(tat, (now, now), c, tol, dom) {
            tat = t;
            admitted += 1;
            assert!(admitted <= 63 * burst, "word {word}");
        }
        #[expect(clippy::cast_precision_loss, reason = "small")]
        let hs = h as f64 * word as f64 / SHARE_ONE as f64;
        let want = if hs >= 1.5 {
            hs * burst as f64
        } else {
            burst as f64
        };
        #[expect(clippy::cast_precision_loss, reason = "small")]
        let got = admitted as f64;
        assert!(
            (got - want).abs() <= 1.0 && got <= want + 1e-9_f64.max(want * 1e-6),
            "word {word}, {h} holders: admitted {admitted}, want {want:.2}"
        );
        // Refill: one packet after a share's cost.
        let later = now + c;
        assert!(
            charge(tat, (later, later), c, tol, dom).is_ok(),
            "word {word}"
        );
    }
}

/// A stretched TAT read once the shares lapse keeps its debt at the whole rate: a bucket
/// at 1/65,536 (one burst) with one token left is not a debt of hours.
#[test]
fn a_lapsed_share_reads_a_stretched_tat_with_its_debt() {
    let (interval, burst) = (MS, 10u64);
    let bits = field(1, 4);
    let dom = domain(true, bits, true);
    let c = cost(interval, dom);
    let tol = pkt_tolerance(burst * interval, interval, c, dom);
    let now = 10_000_000 * MS;
    let mut tat = 0;
    for _ in 0..9 {
        tat = charge(tat, (now, now), c, tol, dom).unwrap();
    }
    assert_ne!(tat & STRETCHED, 0);
    let lapsed = domain(true, bits, false);
    let c1 = cost(interval, lapsed);
    let t1 = pkt_tolerance(burst * interval, interval, c1, lapsed);
    // One token left: one packet conforms at the whole rate, the next not.
    let t = charge(tat, (now, now), c1, t1, lapsed).unwrap();
    assert_eq!(t & STRETCHED, 0);
    assert!(charge(t, (now, now), c1, t1, lapsed).is_err());
    // And the refill is the whole rate's from then on.
    assert!(charge(t, (now + c1, now + c1), c1, t1, lapsed).is_ok());
}

#[test]
fn convert_keeps_tokens_and_marks_the_time() {
    let now = 1_000_000 * MS;
    let tol = 100 * MS;
    let word = 16_384; // a quarter
                       // Whole rate, 40 ms ahead (60 of 100 tokens) -> a quarter: 160 ms ahead, stretched.
    let t = convert(now + 40 * MS, now, 0, word).unwrap();
    assert_eq!(t & STRETCHED, 1);
    assert_eq!(t - now, 160 * MS + 1);
    // Four holders at a quarter: one burst, 60 tokens of it left.
    let tokens_then = tokens(t, now, tol, MS as f64, field(word, 4));
    assert!((tokens_then - 60.0).abs() < 1e-3, "{tokens_then}");
    // Back to the whole rate.
    let back = convert(t, now, word, 0).unwrap();
    assert_eq!(back & STRETCHED, 0);
    assert!((back - now).abs_diff(40 * MS) <= 2);
    // A full bucket stays full, only its mark changes.
    assert_eq!(convert(now - 4, now, 0, word), Some((now - 4) | 1));
    assert_eq!(convert(now - 4, now, 0, 0), None);
}

/// A conversion by [`convert`] (the agent's when it clears a field; the program's, by
/// [`base`], when the shares lapse or come back) keeps the debt in the whole rate's time.
#[test]
fn convert_keeps_the_debt() {
    let now = 1_000_000 * MS;
    for (w1, w2) in [(1_000u64, 30_000u64), (30_000, 1_000), (0, 500), (500, 0)] {
        for debt_ns in [0, 5 * MS, 30 * MS, 200 * MS] {
            let tat = tat_of(debt_ns, now, field(w1, 2));
            let t2 = convert(tat, now, w1, w2).unwrap_or(tat);
            let d2 = debt(t2, now, field(w2, 2));
            assert!(
                d2.abs_diff(debt_ns) <= 4,
                "{w1} -> {w2}: {d2} against {debt_ns}"
            );
        }
    }
}

/// The agent's writes when a share field changes keep the bucket's tokens, at most what the
/// new field holds (never more: a share that grows gives room, not tokens), and every
/// state in between (the interim TAT under the old field or the new) reads as no more than
/// that, over many drawn fields, holders and debts.
#[test]
fn a_field_change_keeps_the_tokens_and_the_states_between_read_no_more() {
    let now = 1_000_000 * MS;
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    for _ in 0..20_000 {
        let interval = 1 + next(10 * MS);
        let burst = 1 + next(1000);
        let tol = burst * interval;
        let from = field(next(3) * next(SHARE_ONE), 1 + next(64));
        let to = field(next(3) * next(SHARE_ONE), 1 + next(64));
        let (k1, k2) = (capacity(tol, interval, from), capacity(tol, interval, to));
        // A TAT in `from`'s time with a debt anywhere from none to past the capacity.
        let d = next(2 * k1 + 2);
        let tat = if next(4) == 0 {
            now - next(MS)
        } else {
            tat_of(d, now, from)
        };
        let tokens = |t: u64, f: u64, k: u64| k as i128 - debt(t, now, f) as i128;
        let had = tokens(tat, from, k1);
        let kept = had.min(k2 as i128);
        let (t, withheld) = interim(tat, now, from, to, k1, k2);
        // Rounding: a few ns per conversion, at most a share's step.
        let slack = 4 + i128::from((SHARE_ONE / share_of(from).min(share_of(to))) as u32);
        assert!(
            tokens(t, from, k1) <= kept + slack,
            "interim under from: {from:#x}->{to:#x} {d}"
        );
        assert!(
            tokens(t, to, k2) <= kept + slack,
            "interim under to: {from:#x}->{to:#x} {d}"
        );
        let f = settle(t, now, to, withheld);
        let got = tokens(f, to, k2);
        assert!(
            got <= kept + slack,
            "settled above: {got} > {kept} ({from:#x}->{to:#x})"
        );
        assert!(
            got >= kept - slack - (kept.max(0) / 1_000_000),
            "settled below: {got} < {kept} ({from:#x}->{to:#x}, {d})"
        );
    }
}

/// The simulator's batch ([`admit`]) and the program's step ([`step`], after [`base`] as the
/// program's `normalize` takes it) are one arithmetic: `k` packets at one instant admit the
/// same number and leave the same TAT either way, for limits local and cluster-scoped, shares
/// in force or lapsed, TATs full, ahead in either time, words from 1 to the whole.
#[test]
fn a_batch_admits_what_as_many_steps_would() {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for case in 0..20_000 {
        let interval = [1u64, 2, 3, 1_000, 1_000_000, 999_983][(next() % 6) as usize];
        let burst = [1u64, 2, 5, 100, 500][(next() % 5) as usize];
        let tolerance = burst * interval;
        let word = [0u64, 1, 2, 0x4000, 0x8000, 0xabcd, 0xffff][(next() % 7) as usize];
        let holders = next() % 9;
        let dom = domain(next() % 4 != 0, field(word, holders), next() % 3 != 0);
        let now = 1_000_000_000_000 + next() % 1_000_000;
        // A TAT behind now (full), or ahead by up to 3 tolerances in either time.
        let ahead = next() % (3 * tolerance.max(1) * 4 + 1);
        let tat = match next() % 3 {
            0 => now - next() % 1_000,
            1 => (now + ahead) | STRETCHED,
            _ => (now + ahead) & !STRETCHED,
        };
        let k = next() % (2 * burst + 3);
        let mut batch = tat;
        let n = admit(&mut batch, now, k, interval, tolerance, dom);
        let c = cost(interval, dom);
        let tol = pkt_tolerance(tolerance, interval, c, dom);
        let mut one = tat;
        let mut m = 0;
        while m < k {
            match charge(one, (now, now), c, tol, dom) {
                Ok(t) => {
                    one = t;
                    m += 1;
                }
                Err(_) => break,
            }
        }
        assert_eq!(
            (n, if n == 0 { tat } else { batch }),
            (m, if m == 0 { tat } else { one }),
            "case {case}: tat {tat} now {now} k {k} interval {interval} burst {burst} dom \
             {dom:#x}"
        );
    }
}
