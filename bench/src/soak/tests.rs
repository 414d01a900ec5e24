//! The soak's arithmetic and verdicts on made-up samples, and the metrics reader.

use super::{
    judge::{judge, slope},
    ops::{metric, EVICTIONS_FULL, EVICTIONS_LOST},
    *,
};

#[test]
fn slope_of_a_line() {
    let pts: Vec<(f64, f64)> = (0..10)
        .map(|i| (f64::from(i), 3.0 * f64::from(i) + 1.0))
        .collect();
    assert!((slope(&pts).unwrap() - 3.0).abs() < 1e-9);
    assert!(slope(&pts[..2]).is_none());
}

/// A 10-minute soak's samples: the map full from 90 s, VmRSS at rest `rss(t)` in KiB.
fn soak(rss: impl Fn(usize, f64) -> u64) -> (Vec<Sample>, Final) {
    let samples: Vec<Sample> = (1..=60)
        .map(|i| {
            let t = 10.0 * f64::from(i);
            let r = rss(i as usize, t);
            Sample {
                t,
                rss_kib: r,
                rss_min_kib: r,
                rss_max_kib: r,
                tracked: if t >= 90.0 { 131_000 } else { 1450 * i as u64 },
                new_buckets: 1450 * i as u64,
                ..Sample::default()
            }
        })
        .collect();
    let fin = Final {
        created: 87_000,
        tracked: 131_000,
        capacity: 131_072,
        frames: 400_000_000,
        traffic_secs: 601.0,
        ..Final::default()
    };
    (samples, fin)
}

fn memory_verdict(rss: impl Fn(usize, f64) -> u64) -> Option<bool> {
    let (samples, fin) = soak(rss);
    let (report, _) = judge(&samples, &fin, Duration::from_secs(600), Value::Null);
    report
        .targets
        .iter()
        .find(|t| t.goal.starts_with("agent memory"))
        .expect("a memory verdict")
        .met
}

#[test]
fn memory_band_without_a_trend_is_flat() {
    // Three levels, switched at calls, as the allocator keeps or trims walk buffers.
    let levels = [54_000, 65_000, 73_700];
    assert_eq!(
        memory_verdict(|i, _| levels[(i * 7 + i / 3) % 3]),
        Some(true)
    );
    assert_eq!(memory_verdict(|_, _| 60_000), Some(true));
}

#[test]
fn memory_growth_is_not_flat() {
    // 1 MiB a minute on top of the band.
    let levels = [54_000, 65_000, 73_700];
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "test"
    )]
    let leak = |i: usize, t: f64| levels[(i * 7 + i / 3) % 3] + (t / 60.0 * 1024.0) as u64;
    assert_eq!(memory_verdict(leak), Some(false));
    // A floor that creeps up while the ceiling stays: still a leak.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "test"
    )]
    let creep = |i: usize, t: f64| {
        if i.is_multiple_of(2) {
            73_700
        } else {
            50_000 + (t * 30.0) as u64
        }
    };
    assert_eq!(memory_verdict(creep), Some(false));
}

#[test]
fn metric_values() {
    let text = "# TYPE ratelimit_buckets_tracked gauge\nratelimit_buckets_tracked 12\n\
                ratelimit_new_buckets_total 34\nratelimit_new_buckets_total_x 1\n";
    assert_eq!(metric(text, "ratelimit_buckets_tracked"), Some(12));
    assert_eq!(metric(text, "ratelimit_new_buckets_total"), Some(34));
    assert_eq!(metric(text, "ratelimit_missing"), None);
    let text = "ratelimit_bucket_evictions_total{state=\"full\"} 5\n\
                ratelimit_bucket_evictions_total{state=\"lost\"} 0\n";
    assert_eq!(metric(text, EVICTIONS_FULL), Some(5));
    assert_eq!(metric(text, EVICTIONS_LOST), Some(0));
}
