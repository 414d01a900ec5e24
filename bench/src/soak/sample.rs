//! A sample as the soak writes it: its JSON record and its row of the table printed as the soak
//! runs.

use serde_json::{json, Value};

use super::Sample;

impl Sample {
    pub(super) fn json(&self) -> Value {
        json!({
            "t": self.t,
            "rss_kib": self.rss_kib,
            "rss_min_kib": self.rss_min_kib,
            "rss_max_kib": self.rss_max_kib,
            "hwm_kib": self.hwm_kib,
            "cpu_pct": self.cpu_pct,
            "gen_mpps": self.gen_mpps,
            "rx_mpps": self.rx_mpps,
            "rx_ring_drops": self.rx_ring_drops,
            "tracked": self.tracked,
            "capacity": self.capacity,
            "new_buckets": self.new_buckets,
            "bucket_errors": self.bucket_errors,
            "passed": self.passed,
            "dropped_rate": self.dropped_rate,
            "no_bucket": self.no_bucket,
            "evicted": self.evicted,
            "evicted_full": self.evicted_full,
            "evicted_lost": self.evicted_lost,
            "metrics_evicted_full": self.metrics_evicted_full,
            "metrics_evicted_lost": self.metrics_evicted_lost,
            "status_tracked": self.status_tracked,
            "reloads_ok": self.reloads_ok,
            "reloads_failed": self.reloads_failed,
            "top_active": self.top_active,
            "metrics_new_buckets": self.metrics_new_buckets,
            "metrics_tracked": self.metrics_tracked,
            "polite_bucket_passed": self.polite_bucket_passed,
            "polite_bucket_dropped": self.polite_bucket_dropped,
            "polite_bucket_age_secs": self.polite_bucket_age_secs,
            "polite_sent": self.polite_sent,
            "polite_received": self.polite_received,
            "ms_status": self.ms_status,
            "ms_stats": self.ms_stats,
            "ms_top": self.ms_top,
            "ms_explain": self.ms_explain,
            "ms_metrics": self.ms_metrics,
            "errors": self.errors,
        })
    }

    pub(super) fn header() -> String {
        format!(
            "{:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>11} {:>7} {:>6} {:>14} {:>8} {:>24}",
            "time",
            "gen",
            "rx",
            "tracked",
            "created",
            "evicted",
            "rss at rest",
            "hwm",
            "cpu",
            "polite",
            "polite",
            "ms: status stats top metrics"
        ) + "\n"
            + &format!(
                "{:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>11} {:>7} {:>6} {:>14} {:>8}",
                "s", "Mpps", "Mpps", "", "", "", "MiB", "MiB", "%", "received", "dropped"
            )
    }

    #[expect(clippy::cast_precision_loss, reason = "KiB to MiB")]
    pub(super) fn row(&self) -> String {
        format!(
            "{:>6.0} {:>6.3} {:>6.3} {:>9} {:>9} {:>9} {:>11} {:>7.1} {:>6.2} {:>14} {:>8} {:>6.0} {:>5.0} {:>5.0} {:>5.0}{}",
            self.t,
            self.gen_mpps,
            self.rx_mpps,
            self.tracked,
            self.new_buckets,
            self.evicted,
            format!(
                "{:.1}-{:.1}",
                self.rss_min_kib as f64 / 1024.0,
                self.rss_max_kib as f64 / 1024.0
            ),
            self.hwm_kib as f64 / 1024.0,
            self.cpu_pct,
            self.polite_received,
            self.polite_bucket_dropped
                .map_or_else(|| "-".into(), |d| d.to_string()),
            self.ms_status,
            self.ms_stats,
            self.ms_top,
            self.ms_metrics,
            if self.errors.is_empty() {
                String::new()
            } else {
                format!("  {} errors", self.errors.len())
            }
        )
    }
}
